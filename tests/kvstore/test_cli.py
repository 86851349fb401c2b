"""The KV store's command line: bad serve options are one line naming the option;
``deepinfer kvstore stats|verify|gc`` report and clean a store directory."""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import pytest

from deepinfer.kvstore import cli
from deepinfer.kvstore.file_tier import FileTier
from deepinfer.kvstore.keys import StoreNamespace, store_key
from deepinfer.kvstore.metrics import TierCounters
from deepinfer.kvstore.pack_tier import PackTier
from deepinfer.kvstore.record import HEADER_SIZE
from deepinfer.kvstore.retention import DEFAULT_TTLS, RetentionPolicy


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    cli.add_serve_args(parser)
    return parser.parse_args(argv)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ("--kv-store-path", "/proc/no/such"),
            "error: --kv-store-path: /proc/no/such is not a writable directory",
        ),
        (("--kv-store-capacity-gib", "0"), "error: --kv-store-capacity-gib: Input should be greater than 0"),
        (("--kv-host-cache-gib", "0"), "error: --kv-host-cache-gib: Input should be greater than 0"),
        (("--kv-ttl", "agent=3days"), "error: --kv-ttl: '3days' is not a positive duration"),
        (("--kv-ttl", "agent"), "error: --kv-ttl: 'agent' is not CLASS=DURATION"),
        (("--kv-default-class", "batch"), "error: --kv-default-class: default_class 'batch' has no TTL"),
        (
            ("--kv-store-path", "/tmp", "--kv-shared-path", "/tmp/"),
            "error: --kv-shared-path: /tmp/ is also the disk tier's path",
        ),
    ],
)
def test_bad_options_are_one_line_naming_the_option(argv: tuple[str, ...], message: str) -> None:
    with pytest.raises(SystemExit) as exc:
        cli.config_from_args(parse(*argv))
    text = str(exc.value)
    assert text.startswith(message) and "\n" not in text


def test_no_option_means_no_store_and_options_make_a_config(tmp_path: Path) -> None:
    assert cli.config_from_args(parse()) is None
    config = cli.config_from_args(
        parse("--kv-store-path", str(tmp_path), "--kv-ttl", "agent=1h,chat=2d,batch=30m")
    )
    assert config.path == str(tmp_path) and config.ttls == {
        "agent": 3600.0,
        "chat": 172800.0,
        "batch": 1800.0,
    }


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict]]:
    parser = argparse.ArgumentParser()
    cli.add_kvstore_args(parser)
    rc = cli.run_kvstore(parser.parse_args(argv))
    return rc, json.loads(capsys.readouterr().out)


def test_stats_verify_and_gc_of_a_disk_tier_of_packs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = StoreNamespace("w", "t", "layout", 16, "float32", (0,), "full")
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    tier = PackTier("disk", tmp_path, ns.digest(), ns.describe(), 1 << 30, policy, TierCounters(), time.time)
    keys = [store_key(ns.digest(), bytes([i]) * 16) for i in range(6)]
    now = time.time()
    tier.write_batch([(keys[0], bytes([0]) * 1000, "agent")], now - DEFAULT_TTLS["agent"] - 1)  # expired
    tier.write_batch([(keys[1], bytes([1]) * 1000, "agent")], now)
    tier.write_batch([(k, bytes([i]) * 1000, "chat") for i, k in enumerate(keys[2:])], now)
    bad = tier.packs_dir / tier.index[keys[1]].pack.name
    raw = bytearray(bad.read_bytes())
    raw[HEADER_SIZE + 10] ^= 1  # a flipped payload bit
    bad.write_bytes(raw)
    rc, [stats] = run_cli(capsys, "stats", str(tmp_path))
    assert rc == 0 and stats["entries"] == 6 and stats["expired"] == 1 and stats["packs"] == 3
    assert stats["by_class"]["agent"]["entries"] == 2 and stats["by_class"]["chat"]["entries"] == 4
    rc, [verified] = run_cli(capsys, "verify", str(tmp_path))
    assert rc == 1 and verified["bad"] == {"checksum": 1}
    rc, [collected] = run_cli(capsys, "gc", str(tmp_path))
    assert collected["expired"] == 1 and collected["bad"] == 1
    rc, [after] = run_cli(capsys, "verify", str(tmp_path))
    assert rc == 0 and after["entries"] == 4 and after["bad"] == {} and after["packs"] == 1
    rc, [evicted] = run_cli(capsys, "gc", str(tmp_path), "--capacity-gib", "0.000001")
    assert evicted["evicted"] == 4 and not list(tmp_path.rglob("*.kvp"))


def test_stats_verify_and_gc(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    ns = StoreNamespace("w", "t", "layout", 16, "float32", (0,), "full")
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    tier = FileTier(
        "shared", tmp_path, ns.digest(), ns.describe(), 1 << 30, True, policy, TierCounters(), time.time
    )
    keys = [store_key(ns.digest(), bytes([i]) * 16) for i in range(6)]
    now = time.time()
    tier.write_batch([(k, bytes([i]) * 1000, "agent" if i < 2 else "chat") for i, k in enumerate(keys)], now)
    os.utime(tier.path(keys[0]), (now, now - 1))  # expired
    raw = bytearray(tier.path(keys[1]).read_bytes())
    raw[-1] ^= 1
    tier.path(keys[1]).write_bytes(raw)
    os.utime(tier.path(keys[1]), (now, now + 3600))

    def run(*argv: str) -> tuple[int, list[dict]]:
        parser = argparse.ArgumentParser()
        cli.add_kvstore_args(parser)
        rc = cli.run_kvstore(parser.parse_args(argv))
        return rc, json.loads(capsys.readouterr().out)

    rc, [stats] = run("stats", str(tmp_path))
    assert rc == 0 and stats["entries"] == 6 and stats["expired"] == 1
    assert stats["by_class"]["agent"]["entries"] == 2 and stats["by_class"]["chat"]["entries"] == 4
    rc, [verified] = run("verify", str(tmp_path))
    assert rc == 1 and verified["bad"] == {"checksum": 1}
    rc, [collected] = run("gc", str(tmp_path))
    assert collected["expired"] == 1 and collected["bad"] == 1
    rc, [after] = run("verify", str(tmp_path))
    assert rc == 0 and after["entries"] == 4 and after["bad"] == {}
    with pytest.raises(SystemExit, match="holds no deepinfer KV store"):
        run("stats", str(tmp_path / "nothing"))


def test_stats_and_gc_of_a_data_parallel_store_read_every_rank_folder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    ns = StoreNamespace("w", "t", "layout", 16, "float32", (0,), "full")
    policy = RetentionPolicy(dict(DEFAULT_TTLS), "chat")
    for rank in range(2):  # what data-parallel ranks leave: PATH/rank-N is each rank's disk tier
        tier = PackTier(
            "disk",
            tmp_path / f"rank-{rank}",
            ns.digest(),
            ns.describe(),
            1 << 30,
            policy,
            TierCounters(),
            time.time,
        )
        keys = [store_key(ns.digest(), bytes([rank, i]) * 8) for i in range(rank + 2)]
        tier.write_batch([(k, bytes([i]) * 1000, "chat") for i, k in enumerate(keys)], time.time())
    rc, stats = run_cli(capsys, "stats", str(tmp_path))
    folder = f"kv1/{ns.digest().hex()[:32]}"
    assert rc == 0 and [s["folder"] for s in stats] == [f"rank-0/{folder}", f"rank-1/{folder}"]
    assert [s["entries"] for s in stats] == [2, 3]
    rc, evicted = run_cli(capsys, "gc", str(tmp_path), "--capacity-gib", "0.000001")
    assert [e["evicted"] for e in evicted] == [2, 3] and not list(tmp_path.rglob("*.kvp"))
