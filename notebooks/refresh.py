"""Run the tutorial notebooks top to bottom and save them with their outputs.

    .venv/bin/python notebooks/refresh.py            # every notebooks/*.ipynb
    .venv/bin/python notebooks/refresh.py 02 03      # by file name, or the start of one

Each notebook runs in a fresh `python3` kernel of the interpreter running this script (the
project's virtualenv), on the CPU (`JAX_PLATFORMS=cpu`). Its text outputs and PNG figures are
stored; the volatile metadata (timings, the kernel's Python version) is not, so a rerun on an
unchanged library gives an unchanged file. A cell that raises stops the script with the error
and a non-zero exit status, and that notebook is left as it was.

The committed outputs are what the documentation site shows (mkdocs-jupyter with
`execute: false`) and what `tests/test_docs.py` checks is there; the test command still runs
the notebooks itself, with nbmake.
"""

import argparse
import os
import pathlib
import re
import sys
import time

import nbformat
from nbclient import NotebookClient
from nbclient.exceptions import CellExecutionError

NOTEBOOKS = pathlib.Path(__file__).resolve().parent
KERNEL = "python3"
CELL_TIMEOUT_S = 600
# C++ log lines (absl/glog: "I0000 00:00:1700000000.123456   1234 file.cc:31] ...") that the
# kernel's libraries write to its stderr, e.g. XLA's CUDA plugin finding no GPU, and absl's
# note before them: timestamps and process ids, nothing for the reader.
NATIVE_LOG = re.compile(
    r"^(WARNING: All log messages before absl::InitializeLog\(\) is called are written to STDERR"
    r"|[IWEF]\d{4} \d\d:\d\d:\d+\.\d+ +\d+ [\w.]+:\d+\] .*"
    # Mosaic GPU's PTX dump also tries to disassemble SASS, with no nvdisasm on a CPU machine.
    r"|nvdisasm invocation failed: .*"
    # XLA's alarm when a CPU compile takes long: a timing of this machine, not an output.
    r"|\*{32}\n\[Compiling module \S+ for CPU\] Very slow compile\?.*\n\*{32}\n?)\n?",
    re.MULTILINE,
)


def find(names: list[str]) -> list[pathlib.Path]:
    """The notebooks named (paths, file names or their starts), or all of them."""
    if not names:
        return sorted(NOTEBOOKS.glob("*.ipynb"))
    found = []
    for name in names:
        path = pathlib.Path(name)
        if path.suffix == ".ipynb" and path.exists():
            found.append(path.resolve())
            continue
        matches = sorted(NOTEBOOKS.glob(f"{path.name.removesuffix('.ipynb')}*.ipynb"))
        if len(matches) != 1:
            sys.exit(f"refresh: {name!r} matches {[m.name for m in matches] or 'no notebook'}")
        found.extend(matches)
    return found


def strip_volatile(nb: nbformat.NotebookNode) -> None:
    """Drops what changes from run to run or machine to machine but says nothing."""
    nb.metadata.get("language_info", {}).pop("version", None)
    nb.metadata.pop("widgets", None)
    for cell in nb.cells:
        cell.metadata.pop("execution", None)  # timestamps
        cell.metadata.pop("ExecuteTime", None)
        outputs = []
        for output in cell.get("outputs", []):
            output.get("metadata", {}).pop("transient", None)
            if output.output_type == "stream" and output.name == "stderr":
                output.text = NATIVE_LOG.sub("", output.text)
                if not output.text:
                    continue
            outputs.append(output)
        if cell.cell_type == "code":
            cell.outputs = outputs


def refresh(path: pathlib.Path) -> None:
    nb = nbformat.read(path, as_version=4)
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs, cell.execution_count = [], None
    client = NotebookClient(
        nb,
        kernel_name=KERNEL,
        timeout=CELL_TIMEOUT_S,
        allow_errors=False,
        record_timing=False,
        coalesce_streams=True,
        resources={"metadata": {"path": str(path.parent)}},
    )
    start = time.perf_counter()
    client.execute()
    strip_volatile(nb)
    nbformat.validate(nb)
    nbformat.write(nb, path)
    images = sum(
        "image/png" in output.get("data", {})
        for cell in nb.cells
        for output in cell.get("outputs", [])
    )
    stderr = [
        output.text
        for cell in nb.cells
        for output in cell.get("outputs", [])
        if output.output_type == "stream" and output.name == "stderr"
    ]
    print(
        f"{path.name}: {time.perf_counter() - start:.0f} s, {images} figure(s), "
        f"{path.stat().st_size / 1024:.0f} KiB"
    )
    for text in stderr:
        print(f"  stderr output (look at it before committing): {text.strip()[:300]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("names", nargs="*", help="notebooks to refresh (default: all)")
    args = parser.parse_args()
    # The kernel inherits this environment. Its interpreter is this one: jupyter_client runs a
    # kernelspec whose command is `python` (ipykernel's `python3`) with `sys.executable`.
    os.environ["JAX_PLATFORMS"] = "cpu"
    for path in find(args.names):
        try:
            refresh(path)
        except CellExecutionError as error:
            sys.exit(f"refresh: {path.name} failed; left unchanged.\n{error}")


if __name__ == "__main__":
    main()
