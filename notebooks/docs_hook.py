"""mkdocs hook (mkdocs.yml `hooks:`): the tutorial notebooks as pages of the site.

The notebooks stay in `notebooks/`, where the test command runs them, outside the docs
directory; this adds each `notebooks/*.ipynb` to the site's files under the same path, which
the nav and the pages link to, and which mkdocs-jupyter renders with its committed outputs
(`execute: false`).
"""

import pathlib

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File

NOTEBOOKS = pathlib.Path(__file__).resolve().parent


@event_priority(100)  # before mkdocs-jupyter's on_files, which picks the notebooks up
def on_files(files, config):
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        # A real file with the repository root as its source dir (mkdocs-jupyter reads
        # `abs_src_path`, which `File.generated` would not keep through its wrapper).
        files.append(
            File(
                f"{NOTEBOOKS.name}/{path.name}",
                src_dir=str(NOTEBOOKS.parent),
                dest_dir=config.site_dir,
                use_directory_urls=config.use_directory_urls,
            )
        )
    return files
