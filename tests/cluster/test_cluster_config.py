"""`[cluster]`: torchrun's variables fill what the file leaves unset, and a wrong rank or size names the fix."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deltafind.cluster.wire import group_spec
from deltafind.config import load_settings
from deltafind.errors import ConfigError


def test_torchrun_variables_fill_unset_keys_and_the_file_wins(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in {
        "RANK": "2",
        "WORLD_SIZE": "4",
        "MASTER_ADDR": "10.1.2.3",
        "MASTER_PORT": "29123",
    }.items():
        monkeypatch.setenv(k, v)
    cfg = tmp_path / "node.toml"
    cfg.write_text('[cluster]\nrole = "expert"\nport = 29999\n')
    spec = group_spec(load_settings(cfg).cluster)
    assert (spec.rank, spec.world_size, spec.address, spec.port, spec.backend) == (
        2,
        4,
        "10.1.2.3",
        29999,
        "gloo",
    )
    off = tmp_path / "off.toml"
    off.write_text("")
    assert (
        load_settings(off).cluster.rank is None
    )  # one machine: the variables are torchrun's business, not ours


@pytest.mark.parametrize(
    ("toml", "message"),
    [
        ('role = "expert"\nrank = 3\nworld_size = 3', r"rank from 1 to 2"),
        ('role = "coordinator"\nrank = 1\nworld_size = 3', r"needs rank 0"),
        ('role = "expert"\nrank = 1', r"world_size is unset"),
        (
            'role = "expert"\nrank = 1\nworld_size = 2\nbackend = "nccl"',
            r"nccl\" is refused: .*never run on GPUs.*backend = \"gloo\"",
        ),
    ],
)
def test_bad_group_names_the_key(
    toml: str, message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)
    cfg = tmp_path / "c.toml"
    cfg.write_text(f"[cluster]\n{toml}\n")
    with pytest.raises(ConfigError, match=message):
        group_spec(load_settings(cfg).cluster)


def test_a_message_body_gives_back_each_tensor_bit_for_bit_and_a_short_one_names_the_version_skew() -> (
    None
):
    """A request's tensors travel as one byte body; odd sizes (a 6-byte text, 3 bf16) keep the next tensor aligned."""
    from deltafind.cluster import wire

    ids, note = torch.tensor([7, -1, 2**40]), wire.text("héllo")
    half, rows = (
        torch.randn(3, dtype=torch.bfloat16),
        torch.randn(2, 3).t(),
    )  # not contiguous: packed as its values
    body = wire.Body(wire.pack((ids, note, half, rows)))
    assert torch.equal(body.take((3,), torch.int64), ids)
    assert body.text(note.numel()) == "héllo"
    assert torch.equal(body.take((3,), torch.bfloat16), half)
    got = body.take((3, 2), torch.float32)
    assert torch.equal(got, rows) and got.data_ptr() % 4 == 0
    assert (
        wire.sent_bytes([1, 2], ids, note, half, rows)
        == 8 * 3 + 24 + 8 + 8 + 24
        == 8 * 3 + body.data.numel()
    )  # header + its byte count
    with pytest.raises(RuntimeError, match=r"too short .* run the same one on every machine"):
        body.take((1,), torch.int64)


def test_sides_of_different_message_layouts_refuse_each_other_with_the_fix() -> None:
    """A node and a coordinator of different deltafind versions name the skew at join (gloo alone
    saw a size mismatch, which read as a lost connection). A real TCPStore on loopback."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist

    from deltafind.cluster import wire

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    store = dist.TCPStore(
        "127.0.0.1", port, None, True, timedelta(seconds=10), wait_for_workers=False
    )

    with pytest.raises(wire.ClusterError, match="did not announce its message layout"):
        wire.announce(store, 1, 0.2)  # no coordinator yet: it names the wait and the version advice
    store.set("deltafind/protocol0", "1")  # an older coordinator's layout
    with pytest.raises(
        wire.ClusterError,
        match=r"the coordinator speaks cluster message layout 1 and this deltafind "
        r"speaks \d+; run the same deltafind version on every machine",
    ):
        wire.announce(store, 1, 0.2)
    store.set("deltafind/protocol0", str(wire.PROTOCOL))
    assert wire.announce(store, 1, 0.2) == 1  # same layout: the node joins (its first generation)
    wire.check_protocol(store, 1, 0)  # and the coordinator accepts it

    with pytest.raises(wire.ClusterError, match="expert node 2 speaks cluster message layout 1"):
        wire.check_protocol(store, 2, 0)  # a node that never wrote one: an older deltafind
