"""A Mooncake L3 configuration that cannot work is refused at server-args
resolution, naming the field, before any scheduler starts.

On 0.5.23 ``--hicache-storage-backend mooncake`` resolves whatever its master
configuration: with no master anywhere each scheduler fails later with an
unnamed error, and with a master address nobody listens on each rank's
``MooncakeDistributedStore.setup`` retries for about 100 s and the scheduler
dies with "Failed to setup Mooncake store, error code: -1". The real
resolution pipeline (``ServerArgs.from_cli_args`` + ``resolve_once``, the
launcher's) on a tiny model config: no master at all, a master address where
nothing listens (from the extra config or ``MOONCAKE_MASTER``) and an address
that is not ``host:port`` are refused naming the field; a master that accepts
connections, ``check_server`` (wait for the master) and a config file are
resolved as before.
"""

import argparse
import json
import os
import socket
import tempfile
import time
import unittest
from pathlib import Path
from unittest import mock

from sglang.test.ci.ci_register import register_cpu_ci

register_cpu_ci(est_time=20, suite="base-a-test-cpu")
FEATURE_GROUP = "fixes"  # the series group it tests (or "series")
PASSES_ON_PRISTINE_TESTS = {
    "test_a_listening_master_check_server_or_a_config_file_resolve": (
        "configurations that can work resolve as upstream resolves them"
    ),
}

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "num_hidden_layers": 2,
    "vocab_size": 1000,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "bfloat16",
}
MOONCAKE_ENV = (
    "MOONCAKE_MASTER",
    "MOONCAKE_CLIENT",
    "MOONCAKE_CHECK_SERVER",
    "SGLANG_HICACHE_MOONCAKE_CONFIG_PATH",
)
BOUND_S = 30.0  # a refusal probes once (5 s at most); setup retries ~100 s


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class TestMooncakeStartupRefusal(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.tmp = tempfile.TemporaryDirectory()
        Path(cls.tmp.name, "config.json").write_text(json.dumps(TINY_LLAMA))

    @classmethod
    def tearDownClass(cls):
        cls.tmp.cleanup()

    def resolve(self, extra_config=None, env=None):
        """Resolves a mooncake L3 command line; returns the error (or None)
        and the seconds resolution took."""
        from sglang.srt.server_args import ServerArgs

        argv = ["--model-path", self.tmp.name, "--device", "cpu"]
        argv += ["--enable-hierarchical-cache", "--hicache-storage-backend"]
        argv += ["mooncake"]
        if extra_config is not None:
            argv += ["--hicache-storage-backend-extra-config"]
            argv += [json.dumps(extra_config)]
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        clean = {k: v for k, v in os.environ.items() if k not in MOONCAKE_ENV}
        with mock.patch.dict(os.environ, dict(clean, **(env or {})), clear=True):
            server_args = ServerArgs.from_cli_args(parser.parse_args(argv))
            start = time.monotonic()
            try:
                server_args.resolve_once()
            except ValueError as e:
                return str(e), time.monotonic() - start
        return None, time.monotonic() - start

    def assertRefused(self, error, elapsed, *needles):
        self.assertIsNotNone(error, "resolved: the configuration was not refused")
        for needle in needles:
            self.assertIn(needle, error)
        self.assertLess(elapsed, BOUND_S)

    def test_no_master_anywhere_is_refused_naming_the_fields(self):
        error, elapsed = self.resolve()
        self.assertRefused(
            error, elapsed, "master_server_address", "MOONCAKE_MASTER", "mooncake"
        )

    def test_a_master_nobody_listens_on_is_refused_naming_its_field(self):
        address = f"127.0.0.1:{closed_port()}"
        error, elapsed = self.resolve({"master_server_address": address})
        self.assertRefused(error, elapsed, "master_server_address", address)
        error, elapsed = self.resolve(env={"MOONCAKE_MASTER": address})
        self.assertRefused(error, elapsed, "MOONCAKE_MASTER", address)

    def test_an_address_that_is_not_host_port_is_refused(self):
        error, elapsed = self.resolve({"master_server_address": "127.0.0.1"})
        self.assertRefused(error, elapsed, "master_server_address", "host:port")

    def test_a_listening_master_check_server_or_a_config_file_resolve(self):
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen()
            address = "127.0.0.1:%d" % listener.getsockname()[1]
            error, _ = self.resolve({"master_server_address": address})
            self.assertIsNone(error)
        # the operator asked to wait for the master: no probe
        closed = f"127.0.0.1:{closed_port()}"
        config = {"master_server_address": closed, "check_server": True}
        self.assertIsNone(self.resolve(config)[0])
        # a config file is read by the scheduler, as upstream reads it
        path = Path(self.tmp.name, "mooncake.json")
        path.write_text(json.dumps({"master_server_address": closed}))
        error, _ = self.resolve(env={"SGLANG_HICACHE_MOONCAKE_CONFIG_PATH": str(path)})
        self.assertIsNone(error)


if __name__ == "__main__":
    unittest.main()
