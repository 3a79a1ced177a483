"""Variable sequence lengths in one process: which tables bound the length, the hint
towards the flag, and the warning when too many shapes are compiled (the parity cases
are in tests/parity/test_variable_lengths.py)."""

from __future__ import annotations

import copy
import logging

import pytest
import torch

import fxmeg
from fxmeg.errors import BatchError
from fxmeg.frontend.pass_driver import transform
from fxmeg.ir.program import PositionTable
from fxmeg.passes.analyse import position_tables
from tests.harness.helpers import make_batch
from tests.harness.models import hf_model, make_model


def test_the_tables_read_one_row_per_position_are_found():
    gpt = transform(
        make_model("gpt", n_layer=1), make_batch(2, seed=0, seq=8), stop_after="analyse"
    )
    assert position_tables(gpt) == [PositionTable("position embedding 'wpe'", 16, 0, 1)]
    llama = transform(
        make_model("llama", n_layer=1), make_batch(2, seed=0, seq=8), stop_after="analyse"
    )
    assert [(t.what, t.rows) for t in position_tables(llama)] == [
        ("table 'rope_cos' (dimension 0)", 16), ("table 'rope_sin' (dimension 0)", 16)]

    # Hugging Face GPT-2: positions = arange(s) + the cache's length (0), unsqueezed
    gpt2 = hf_model("gpt2", n_layer=1)
    found = position_tables(transform(gpt2, make_batch(2, seed=0, seq=8), stop_after="analyse"))
    assert found == [
        PositionTable("position embedding 'transformer.wpe'", gpt2.config.n_positions, 0, 1)
    ]


def test_another_length_without_the_flag_names_it():
    engine = fxmeg.parallelize(
        make_model("gpt", n_layer=1), make_batch(2, seed=0), global_batch_size=2
    )
    with pytest.raises(BatchError, match="pass variable_seq_lengths=True"):
        engine.train_step(make_batch(2, seed=1, seq=8))


def test_many_compiled_shapes_are_warned_about(caplog):
    engine = fxmeg.parallelize(
        make_model("gpt", n_layer=1),
        make_batch(2, seed=0),
        global_batch_size=2,
        variable_seq_lengths=True,
    )
    with caplog.at_level(logging.INFO, logger="fxmeg.frontend.variable_shapes"):
        for seq in range(1, 16):
            engine.train_step(make_batch(2, seed=seq, seq=seq))
        engine.train_step(make_batch(2, seed=0, seq=3))  # compiled already
    compiled = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(compiled) == len(engine.shapes.compiled) == 15
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("16 input shapes compiled")


class _LengthConstant(torch.nn.Module):
    """Adds a constant made in forward from the sequence length (lifted by export)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.head = torch.nn.Embedding(128, 16), torch.nn.Linear(16, 128)

    def forward(self, ids, labels):
        h = self.emb(ids) + torch.tensor(float(ids.shape[1]))
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_constant_made_in_forward_is_each_shapes_own():
    """A Program of another length shares the parameters, not the constants of the
    example's capture (they shared them: the loss at length 8 used 16.0)."""
    torch.manual_seed(0)
    model = _LengthConstant()
    plain = copy.deepcopy(model)
    engine = fxmeg.parallelize(
        model, make_batch(2, seed=0), global_batch_size=2, variable_seq_lengths=True
    )
    batch = make_batch(2, seed=1, seq=8)
    with torch.no_grad():
        want = plain(*batch).item()
    assert engine.train_step(batch).loss == pytest.approx(want, rel=1e-6)


class _TableInForward(_LengthConstant):
    """Makes a (length, 16) table from Python values in forward."""

    def forward(self, ids, labels):
        table = torch.tensor([[float(p * i) for i in range(16)] for p in range(ids.shape[1])])
        h = self.emb(ids) + table
        return torch.nn.functional.cross_entropy(self.head(h).flatten(0, 1), labels.flatten())


def test_a_table_made_in_forward_cannot_be_recaptured_and_says_why():
    engine = fxmeg.parallelize(_TableInForward(), make_batch(2, seed=0), global_batch_size=2,
                               variable_seq_lengths=True)
    with pytest.raises(
        BatchError, match=r"shape \(b, 8\), \(b, 8\) .* register such a table as a buffer"
    ):
        engine.train_step(make_batch(2, seed=1, seq=8))
