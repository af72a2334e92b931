"""tasks.base: hub datasets that are not at hand fail in seconds with one line; a dataset without documents."""

from __future__ import annotations

import socket
import time

import pytest

from pardec import hub
from pardec.config import DatasetConfig
from pardec.tasks.base import DataError, build_task, load_hub, select_docs

NOT_CACHED = "pardec-tests/no-such-dataset"


@pytest.fixture
def no_network(monkeypatch):
    """Every connection attempt and name lookup is recorded and refused: the tests assert there were none."""
    calls: list = []

    def refuse(*args, **kwargs):
        calls.append(args)
        raise OSError("network disabled in this test")

    monkeypatch.setattr(socket.socket, "connect", refuse)
    monkeypatch.setattr(socket, "create_connection", refuse)
    monkeypatch.setattr(socket, "getaddrinfo", refuse)
    return calls


def _online(monkeypatch) -> None:
    """No offline switch set, whatever the environment running the tests has."""
    import datasets.config
    import huggingface_hub.constants

    for k in (*hub.DATASET_OFFLINE_VARS, *hub.MODEL_OFFLINE_VARS):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)


@pytest.mark.parametrize("var", ["HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"])
def test_offline_env_var_fails_fast_without_touching_the_network(monkeypatch, no_network, var):
    _online(monkeypatch)  # the switch is set after `datasets` read the environment: it must still be honoured
    monkeypatch.setenv(var, "1")
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: pytest.fail("probed the hub while offline"))
    t0 = time.perf_counter()
    with pytest.raises(DataError) as e:
        load_hub(NOT_CACHED, None, "train", "mt_bench")
    assert time.perf_counter() - t0 < 5  # a generous bound: no ~30 s of retries
    msg = str(e.value)
    assert "\n" not in msg and no_network == []
    for needle in (repr(NOT_CACHED), f"offline mode is on ({var})", "dataset.path=<file>", "conf/dataset/mt_bench"):
        assert needle in msg, (needle, msg)


def test_unreachable_hub_reads_the_cache_only(monkeypatch, no_network):
    import datasets.config

    _online(monkeypatch)
    probes = []
    monkeypatch.setattr(hub, "hub_reachable", lambda timeout=3.0: probes.append(timeout) or False)
    with pytest.raises(DataError) as e:
        load_hub(NOT_CACHED, "cfg", "test", "wmt16")
    msg = str(e.value)
    assert probes and no_network == []  # one probe (patched), then the cache only: no retries
    assert f"could not load dataset {NOT_CACHED!r} (config 'cfg', split 'test')" in msg
    assert "the Hugging Face hub cannot be reached (no network)" in msg and "dataset.path=<file>" in msg
    assert datasets.config.HF_HUB_OFFLINE is False  # offline mode was switched on for the call only


def test_a_dataset_without_documents_names_its_source(tmp_path):
    empty = tmp_path / "q.jsonl"
    empty.write_text("")
    task = build_task(DatasetConfig(name="mt_bench", path=str(empty)))
    with pytest.raises(DataError, match=f"dataset 'mt_bench' has no documents: dataset.path={empty} holds no "):
        select_docs(task)
    one = tmp_path / "one.jsonl"
    one.write_text('{"question_id": 1, "category": "x", "turns": ["a", "b"]}\n')
    assert len(select_docs(build_task(DatasetConfig(name="mt_bench", path=str(one))), 5)) == 1
