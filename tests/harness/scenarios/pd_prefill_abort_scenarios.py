"""A PD prefill worker's real mooncake KV manager (``MooncakeKVManager``, its
bootstrap thread and zmq socket, a TCP-only transfer engine, the bootstrap
server) on one gloo rank, sent decode's ABORT message as a decode worker's KV
receiver sends it (``AbortNotification.to_zmq()`` over a PUSH socket to the
rank's port), and the request's ``MooncakeKVSender`` created as prefill's
bootstrap queue creates it.
"""

from __future__ import annotations

import os
import socket
import time

import torch

UPSTREAM_TEST_MODULE = "sglang.test.pd_prefill_abort_scenarios"

HOST = "127.0.0.1"
SYNC_TIMEOUT_S = 60.0  # the bootstrap thread handles a message in milliseconds


def _free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def mooncake_prefill(rank: int, world_size: int):
    """A prefill rank's ``MooncakeKVManager`` over small CPU buffers and the
    bootstrap address its senders are given."""
    os.environ.setdefault("SGLANG_HOST_IP", HOST)  # the address mooncake binds
    os.environ.setdefault("MC_FORCE_TCP", "1")  # TCP transport: no RDMA on CPU
    from sglang.srt.disaggregation.base.conn import KVArgs
    from sglang.srt.disaggregation.mooncake.conn import (
        MooncakeKVBootstrapServer,
        MooncakeKVManager,
    )
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.distributed.device_communicators.mooncake_transfer_engine import (
        maybe_init_shared_mooncake_transfer_engine,
    )

    from harness.stacks.dsa_hicache_stack import (
        init_scheduler_groups,
        publish_server_args,
    )

    port = _free_port()
    server_args = publish_server_args(
        rank,
        world_size,
        enable_hierarchical_cache=False,
        host=HOST,
        disaggregation_mode="prefill",
        disaggregation_transfer_backend="mooncake",
        disaggregation_bootstrap_port=port,
    )
    init_scheduler_groups(server_args, rank, world_size)
    MooncakeKVBootstrapServer(host=HOST, port=port)
    maybe_init_shared_mooncake_transfer_engine(gpu_id=0)
    kv = torch.zeros(64 * 64, dtype=torch.uint8)
    aux = torch.zeros(16 * 16, dtype=torch.uint8)
    args = KVArgs()
    args.engine_rank = rank
    args.kv_data_ptrs, args.kv_data_lens = [kv.data_ptr()], [kv.numel()]
    args.kv_item_lens, args.kv_layer_ids = [64], [0]
    args.kv_cache_dtype_str = "bfloat16"
    args.aux_data_ptrs, args.aux_data_lens = [aux.data_ptr()], [aux.numel()]
    args.aux_item_lens = [16]
    args.state_types, args.state_data_ptrs, args.state_data_lens = [], [], []
    args.state_item_lens, args.state_layer_ids = [], []
    args.ib_device, args.gpu_id, args.page_size = None, 0, 1
    args.system_dp_rank, args.pp_rank, args.prefill_start_layer = 0, 0, 0
    manager = MooncakeKVManager(args, DisaggregationMode.PREFILL, server_args, True)
    manager._test_buffers = (kv, aux)  # the registered memory outlives the test
    return manager, f"{HOST}:{port}"


def early_decode_abort(
    rank: int, world_size: int, *, expired_abort_s: float | None = None
) -> dict:
    """Decode aborts room ``early`` before prefill creates its sender; room
    ``present`` already has a sender when its abort comes (0.5.23 fails it),
    room ``never`` is never aborted. With ``expired_abort_s``, room
    ``expired`` is aborted first and its sender created that many seconds
    later. The ABORTs go out on one PUSH socket, whose order the bootstrap
    thread keeps: once ``present`` polls Failed, every ABORT before it was
    handled. Returns each sender's first poll (a ``KVPoll`` name), the
    failure reason of each failed one, and the rooms the manager retains
    before the senders are created and after."""
    import zmq
    from sglang.srt.disaggregation.base.conn import KVPoll
    from sglang.srt.disaggregation.common.conn import AbortNotification
    from sglang.srt.disaggregation.mooncake.conn import MooncakeKVSender

    manager, bootstrap_addr = mooncake_prefill(rank, world_size)
    rooms = dict(early=1001, present=1002, never=1003, expired=1004)
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(f"tcp://{HOST}:{manager.rank_port}")
    decode_port = _free_port()  # decode's return address (the ABORT ack)

    def abort(name):
        note = AbortNotification(
            room=rooms[name], decode_ip=HOST, decode_port=decode_port
        )
        push.send_multipart(note.to_zmq())

    def sender(name):
        return MooncakeKVSender(manager, bootstrap_addr, rooms[name])

    def sync(present):
        deadline = time.monotonic() + SYNC_TIMEOUT_S
        while present.poll() != KVPoll.Failed:
            assert time.monotonic() < deadline, "the bootstrap thread is stuck"
            time.sleep(0.01)

    def retained():
        return sorted(getattr(manager, "_early_aborts", {}))

    senders = {}
    if expired_abort_s is not None:
        senders["present"] = sender("present")
        abort("expired")
        abort("present")
        sync(senders["present"])
        time.sleep(expired_abort_s)
        rooms["present"] = 1005  # a second present room for the next sync
    senders["present"] = sender("present")
    abort("early")
    abort("present")
    sync(senders["present"])
    retained_before = retained()
    late = ["early", "never"] + (["expired"] if expired_abort_s is not None else [])
    for name in late:
        senders[name] = sender(name)
    names = {
        getattr(KVPoll, n): n
        for n in ("Failed", "Bootstrapping", "WaitingForInput", "Transferring")
    }
    polls = {name: names.get(s.poll(), "other") for name, s in senders.items()}
    reasons = {}
    for name, s in senders.items():
        if polls[name] == "Failed":
            try:
                s.failure_exception()
            except Exception as e:  # KVTransferError, as prefill gets it
                reasons[name] = str(e)
    push.close(linger=0)
    return dict(
        polls=polls,
        reasons=reasons,
        retained_before=retained_before,
        retained_after=retained(),
        rooms=rooms,
        bootstrap_timeout=manager.bootstrap_timeout,
    )
