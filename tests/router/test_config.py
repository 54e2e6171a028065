"""``sloserve router``'s flags and the checks on them."""
from __future__ import annotations

import argparse
from dataclasses import fields

import pytest

from sloserve.cli import main
from sloserve.router.args import add_router_args, config_from_args
from sloserve.router.config import RouterConfig, events_endpoint


def _parse(*argv: str) -> RouterConfig:
    p = argparse.ArgumentParser()
    add_router_args(p)
    return config_from_args(p.parse_args(list(argv)))


def test_flag_defaults_are_the_configs():
    p = argparse.ArgumentParser()
    add_router_args(p)
    flags = vars(p.parse_args([]))
    for f in fields(RouterConfig):
        if f.name in flags and not isinstance(flags[f.name], list):
            assert flags[f.name] == f.default, f.name


def test_replicas_and_policies():
    c = _parse("--replicas", "127.0.0.1:8001", "http://h2:8002/", "--routing-policy",
               "round-robin")
    assert c.replicas == ["http://127.0.0.1:8001", "http://h2:8002"] and not c.disaggregated
    assert c.policy == "round-robin"
    assert _parse("--replicas", "a:1").policy == "least-outstanding"
    c = _parse("--replicas", "10.0.0.1:8000", "10.0.0.2:8000", "--kv-events-config",
               '{"enable_kv_cache_events": true, "endpoint": "tcp://*:5557", '
               '"replay_endpoint": "tcp://*:5558"}')
    assert c.policy == "prefix-aware"
    assert c.events_endpoints() == [("tcp://10.0.0.1:5557", "tcp://10.0.0.1:5558"),
                                    ("tcp://10.0.0.2:5557", "tcp://10.0.0.2:5558")]
    c = _parse("--prefill", "p:1", "--decode", "d:1", "d:2", "--kv-transfer-flow", "serial")
    assert c.disaggregated and c.routed == ["http://p:1"] and c.kv_transfer_flow == "serial"


@pytest.mark.parametrize("argv, words", [
    ((), "--replicas"),
    (("--replicas", "a:1", "--prefill", "p:1", "--decode", "d:1"), "not both"),
    (("--prefill", "p:1"), "go together"),
    (("--replicas", "a:1", "a:1"), "twice"),
    (("--replicas", "a:1", "--routing-policy", "prefix-aware"), "--kv-events-config"),
    (("--replicas", "a:1", "b:1", "--kv-events-endpoints", "tcp://a:1"), "one endpoint per"),
    (("--replicas", "127.0.0.1:1", "127.0.0.1:2", "--kv-events-config",
      '{"endpoint": "tcp://*:5557"}'), "--kv-events-endpoints"),
    (("--replicas", "a:1", "--kv-events-config", '{"endpoint": "ipc:///tmp/x"}'), "local"),
    (("--replicas", "a:1", "--kv-events-config", '{"nope": 1}'), "unknown field"),
    (("--replicas", "a:1", "--cache-threshold", "1.5"), "--cache-threshold"),
    (("--replicas", "a:1", "--health-check-interval", "0"), "--health-check-interval"),
    (("--replicas", "ftp://a:1"), "worker URL"),
    (("--replicas", "a:99999"), "worker URL"),
    (("--replicas", "a:notaport"), "worker URL"),
    (("--replicas", "http://a:1/v1"), "worker URL"),
    (("--replicas", "a:1", "--health-check-timeout", "nan"), "--health-check-timeout"),
    (("--replicas", "a:1", "--connect-timeout", "nan"), "--connect-timeout"),
    (("--replicas", "a:1", "--kv-transfer-flow", "serial"), "not --replicas"),
])
def test_bad_settings_are_refused(argv, words):
    with pytest.raises(ValueError, match=words):
        _parse(*argv)


def test_the_cli_reports_bad_settings(capsys):
    assert main(["router", "--replicas", "a:1", "--routing-policy", "prefix-aware"]) == 2
    assert "--kv-events-config" in capsys.readouterr().err


def test_events_endpoint_from_a_workers_config():
    assert events_endpoint("tcp://*:5557", "http://10.1.2.3:8000") == "tcp://10.1.2.3:5557"
    assert events_endpoint("tcp://0.0.0.0:7", "http://[::1]:8000") == "tcp://[::1]:7"
    assert events_endpoint("tcp://fwd:9", "http://10.1.2.3:8000") == "tcp://fwd:9"
    assert events_endpoint("ipc:///tmp/e", "http://localhost:8000") == "ipc:///tmp/e"
