"""The KV connector's scheduler half (vLLM's ``KVConnectorBase_V1`` scheduler-side methods):
which requests' KV comes from or goes to another instance, and when their blocks may be freed.
Plain Python, no torch and no clock (the scheduler passes ``now``): the simulator can run it.

A decode instance's request with ``do_remote_prefill`` takes all of its prompt's blocks at
admission (its prefix-cache hits here too, with ``incremental``), then waits, holding them,
until the worker half reports its KV and first token arrived; a prefill instance's request with
``do_remote_decode`` is registered as a save when first scheduled and, once finished, keeps its
blocks until the worker half reports them sent (or the transfer failed or was cancelled). A
transfer that passes ``timeout_s`` (from the decode side's admission; from the prefill side's
finish) is cancelled; the scheduler frees its blocks when the worker half confirms.
"""
from __future__ import annotations

from sloserve.config import KVTransferConfig
from sloserve.step_io import KVConnectorMetadata, KVLoad, KVSave, SchedulerOutput


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class SloserveConnectorScheduler:
    """The scheduler half of ``SloserveConnector``.

    Args:
        config: the KV transfer settings.
        block_size: tokens per KV block.
        host, port: where this instance's worker half listens (returned to clients in a
            prefill instance's ``kv_transfer_params``).
    """

    def __init__(self, config: KVTransferConfig, block_size: int, host: str, port: int):
        self.config = config
        self.block_size = block_size
        self.host, self.port = host, port
        self.engine_id = config.engine_id or f"{host}:{port}"
        self._meta = KVConnectorMetadata()
        #: decode side: requests whose transfer is in flight -> deadline (s)
        self.loading: dict[str, float] = {}
        #: prefill side: registered saves -> deadline once finished (None while running)
        self.saving: dict[str, float | None] = {}
        #: prefill side: saves whose transfer already failed or stopped (nothing to hold)
        self._send_over: set[str] = set()
        #: finished requests whose blocks wait for the worker half's report
        self.held: set[str] = set()
        #: transfers cancelled for passing timeout_s (each also counts as a failure)
        self.num_timeouts = 0
        #: decode-side requests whose load timed out, until the worker half confirms
        self.timed_out: set[str] = set()

    # ------------------------------------------------------------------ vLLM's methods
    @staticmethod
    def is_remote_prefill(request) -> bool:
        kv = request.kv_transfer_params
        return kv is not None and kv.do_remote_prefill

    @staticmethod
    def is_remote_decode(request) -> bool:
        kv = request.kv_transfer_params
        return kv is not None and kv.do_remote_decode

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past ``num_computed_tokens`` (the local prefix-cache hits) whose KV another
        instance provides, and whether they arrive asynchronously: the rest of the prompt for
        a ``do_remote_prefill`` request, else none."""
        if not self.is_remote_prefill(request):
            return 0, False
        return request.num_prompt_tokens - num_computed_tokens, True

    def update_state_after_alloc(self, request, block_ids: list[int], num_external_tokens: int,
                                 now: float) -> None:
        """A request got its blocks: a remote prefill's load (``num_external_tokens`` to
        receive after its local hits), or a remote decode's save (at its first admission)."""
        kv, rid = request.kv_transfer_params, request.request_id
        L = request.num_prompt_tokens
        if kv.do_remote_prefill and num_external_tokens > 0:
            pull = self.config.mode == "pull"
            if pull and not (kv.remote_host and kv.remote_port):
                raise ValueError(f"{rid}: pull mode needs remote_host and remote_port in "
                                 f"kv_transfer_params (the prefill instance's connector)")
            self._meta.loads.append(KVLoad(
                kv.transfer_id or rid, rid, list(block_ids[:cdiv(L, self.block_size)]),
                (L - num_external_tokens) // self.block_size, L,
                kv.remote_host if pull else None, kv.remote_port if pull else None))
            self.loading[rid] = now + self.config.timeout_s
        elif kv.do_remote_decode and rid not in self.saving:
            push = self.config.mode == "push" and kv.remote_host is not None
            self._meta.saves.append(KVSave(kv.transfer_id or rid, rid, L,
                                           kv.remote_host if push else None,
                                           kv.remote_port if push else None))
            self.saving[rid] = None

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        """The news for the worker half since the previous step (then forgotten here)."""
        meta, self._meta = self._meta, KVConnectorMetadata()
        return meta

    def request_finished(self, request, block_ids: list[int]) -> tuple[bool, dict | None]:
        """A request finished (or was aborted): (keep its blocks until the worker half reports,
        the ``kv_transfer_params`` of its response, as a dict). A decode-side request still loading is
        cancelled; a prefill-side one stays until sent (its response names this instance and
        the transfer, for the decode instance's request: the serial flow), unless it was
        aborted or, in the serial flow, its first token ended it (then no decode side asks)."""
        rid = request.request_id
        if rid in self.loading:
            del self.loading[rid]
            self._cancel(rid)
            return True, None
        if rid not in self.saving:
            return False, None
        if rid in self._send_over:
            self._send_over.discard(rid)
            del self.saving[rid]
            return False, None
        self.held.add(rid)
        kv = request.kv_transfer_params
        # aborted, or (the serial flow) its first token ended it: no decode side will ask
        if request.status.value == "abort" or (request.status.value == "stop"
                                               and kv.transfer_id is None):
            del self.saving[rid]
            self._cancel(rid)
            return True, None
        return True, dict(
            do_remote_prefill=True, transfer_id=kv.transfer_id or rid,
            remote_engine_id=self.engine_id, remote_host=self.host, remote_port=self.port,
            remote_block_ids=list(block_ids))

    def _cancel(self, rid: str) -> None:
        self.held.add(rid)
        self._meta.cancels.append(rid)

    # ------------------------------------------------------------------ the scheduler's calls
    def expired(self, now: float) -> None:
        """Cancel the transfers past their deadline (a decode-side request waits for the
        worker half's confirmation, then fails or recomputes: ``timed_out`` names it)."""
        for rid, deadline in list(self.saving.items()):
            if rid in self.held and deadline is None:
                self.saving[rid] = now + self.config.timeout_s  # the hold starts now
            elif deadline is not None and now >= deadline:
                del self.saving[rid]
                self._meta.cancels.append(rid)
                self.num_timeouts += 1
        for rid, deadline in list(self.loading.items()):
            if now >= deadline:
                del self.loading[rid]
                self._meta.cancels.append(rid)
                self.num_timeouts += 1
                self.timed_out.add(rid)

    def sent(self, rid: str) -> bool:
        """The worker half is done with a save (sent, failed or cancelled). Returns whether
        the request was finished and holding blocks (now to be freed)."""
        if rid in self.held:
            self.saving.pop(rid, None)
            self.held.discard(rid)
            return True
        if rid in self.saving:  # still running: its finish frees its blocks at once
            del self.saving[rid]
            self._send_over.add(rid)
        return False

    def load_over(self, rid: str) -> bool:
        """The worker half is done with a load (arrived, failed or cancelled). Returns whether
        the request was finished meanwhile and holds blocks to free."""
        self.loading.pop(rid, None)
        self.timed_out.discard(rid)
        if rid in self.held:
            self.held.discard(rid)
            return True
        return False

    def has_pending(self) -> bool:
        """Blocks held for the worker half, or news it has not had yet."""
        return bool(self.held or self.loading or self.saving or not self._meta.is_empty)
