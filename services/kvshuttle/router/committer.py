"""CommitTurn and AbortTurn: how a planned turn finishes.

A commit stores what decode retained as the conversation's next retention (fenced by the turn's
generation, so an older turn's commit never replaces a newer one), releases the retention the
turn claimed, and feeds the turn's measured times back into the cost model. An abort releases
the claim. Either finishes the turn: a second commit or abort is TURN_FINISHED.

Neither fails for a registry that does not answer: its calls here give up after
`commit_registry_timeout_s` (a dead registry holds neither the commit nor the conversation's
next turn, which waits for it, longer than that), and then the commit succeeds with nothing
stored (an empty `retention`; logged `commit.not_stored reason=REGISTRY_UNAVAILABLE`, counted as
outcome `registry_unavailable`), and a release that did not reach the registry is logged: the
claim lapses on its own TTL, and the retention with it. The call itself is not cut short then: it
goes on (within the registry client's own deadline), so a registry that is slow, not dead (an
overloaded machine), still stores the retention and releases the claim, and the conversation's
later turns reuse it instead of recomputing until the claim's TTL (CLAIM_LOST).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from dataclasses import replace
from typing import Any, TypeVar

import numpy as np
import numpy.typing as npt
import structlog
from opentelemetry import trace

from kvshuttle.core.digest import log_name
from kvshuttle.core.errors import Aborted, FailedPrecondition, InvalidArgument, NotFound, Unavailable
from kvshuttle.core.hashing import token_array
from kvshuttle.core.limits import MAX_BLOCK_HASHES, MAX_GENERATION
from kvshuttle.core.names import check_id
from kvshuttle.core.reasons import ErrorReason
from kvshuttle.router import checks
from kvshuttle.router.chains import NO_CHAIN, Chain
from kvshuttle.router.model import (
    CommitRequest,
    CommitResult,
    Decision,
    NewRetention,
    Reason,
    RetentionInfo,
    TranscriptInfo,
    TurnEnd,
    TurnTimings,
)
from kvshuttle.router.parts import RouterParts
from kvshuttle.router.timing import CallTimer
from kvshuttle.router.turn_memory import commit_fingerprint
from kvshuttle.router.turns import TurnState
from kvshuttle.vllm.block_ids import block_groups

log = structlog.get_logger("kvshuttle.router")

T = TypeVar("T")

# Blocks of tokens a hint keeps per retention (MAX_KNOWN_BLOCKS * block_size uint32s).
MAX_KNOWN_BLOCKS = 64

_NOTHING_STORED = CommitResult("", None)
_REGISTRY_UNAVAILABLE = CommitResult("", None, not_stored="registry_unavailable")


class Committer:
    def __init__(self, parts: RouterParts) -> None:
        self._parts = parts
        # Registry calls a commit or an abort stopped waiting for, held so that they land.
        self._landing: set[asyncio.Future[Any]] = set()

    def _unfinished(self, handle: str) -> TurnState:
        """The turn of `handle`; FailedPrecondition when it was committed or aborted here."""
        state = self._parts.codec.decode(handle)
        self._check_unfinished(state)
        return state

    def _finish(self, state: TurnState, outcome: str) -> None:
        """Remembered as finished here; its decode no longer counts on its node's load."""
        self._parts.memory.finish(state.turn_id, outcome)
        self._parts.ledger.finished(state.turn_id)

    def _check_unfinished(self, state: TurnState) -> None:
        finished = self._parts.memory.finished(state.turn_id)
        if finished is not None:
            raise FailedPrecondition(f"turn already {finished}", reason=ErrorReason.TURN_FINISHED)

    # ---- CommitTurn ------------------------------------------------------------------------

    async def commit_turn(self, req: CommitRequest) -> CommitResult:
        timer = CallTimer()
        policy = self._parts.policy
        if req.request_id:
            check_id(req.request_id, "request_id", max_length=policy.max_id_length)
        state = self._parts.codec.decode(req.turn)
        tokens, planned = self._sequence(req, state)
        checks.timings(req.timings)
        fingerprint = b""
        if req.request_id:
            fingerprint = commit_fingerprint(req, tokens)
            # A retry whose first answer was lost; another body under the id is REQUEST_ID_REUSED.
            earlier = self._parts.memory.earlier_commit(state.turn_id, req.request_id, fingerprint)
            if earlier is not None:
                return earlier
        self._check_unfinished(state)
        if self._parts.clock.now() >= state.expire_at:
            raise FailedPrecondition("turn expired; its claim is gone", reason=ErrorReason.TURN_EXPIRED)
        if tokens.size < state.prompt_tokens:
            raise InvalidArgument("token_ids", "shorter than the planned prompt")
        transcript = checks.transcript(req.transcript, tokens)
        params = req.decode_kv_transfer_params
        retains = bool(params and params.get("do_remote_decode") and block_groups(params)[0])
        if retains and params is not None:
            _check_decode_node(params, state)
        with self._parts.tracer.start_as_current_span("commit", context=_trace_parent(state)) as span:
            chain: Chain = NO_CHAIN
            if state.conversation and state.prompt_full_blocks:
                chain = self._parts.chains.chain(
                    state.conversation, tokens, state.block_size, root=state.chain_root, starts_with=planned
                )
                if (
                    len(chain) < state.prompt_full_blocks
                    or chain[state.prompt_full_blocks - 1] != state.prompt_tail_hash
                ):
                    raise InvalidArgument("token_ids", "does not start with the planned prompt")
            # Read or not, a claimed retention is consumed: prefill notified its holder. A stored
            # put removed it already (a put replaces whatever the conversation holds, claimed or
            # not: one registry call, not two); otherwise it is released here, unless the
            # registry did not answer the put: then the claim lapses on its TTL, the retention
            # with it, and the commit waits for one timeout, not two.
            result = _NOTHING_STORED
            try:
                with self._parts.memory.storing(state.conversation):
                    result = await self._store(
                        state, tokens, chain, params if retains else None, timer, req.turn_end, transcript
                    )
            finally:
                await self._end_claim(state, result, timer)
            self._tell_shuttle(state, result, req.turn_end)
            self._observe(state, req.timings)
            self._finish(state, "committed")
            if req.request_id:
                self._parts.memory.remember_commit(state.turn_id, req.request_id, fingerprint, result)
            outcome = result.not_stored or ("stored" if result.retention else "nothing_retained")
            self._parts.metrics.committed(outcome, req.turn_end.value)
            _describe(span, state, result.retention, req.timings)
        own = timer.log_fields()  # read once: the metric and the log line agree
        self._parts.metrics.own_commit.observe(own["own_cpu_ms"] / 1e3)
        structlog.contextvars.bind_contextvars(retention=log_name(result.retention), **own)
        return result

    def _tell_shuttle(self, state: TurnState, result: CommitResult, end: TurnEnd) -> None:
        shuttle = self._parts.shuttle
        if not state.conversation or shuttle is None:
            return
        if not result.retention:
            shuttle.forget(state.conversation)  # what it had scheduled was consumed
        shuttle.turn_ended(state.conversation, end)

    def _sequence(
        self, req: CommitRequest, state: TurnState
    ) -> tuple[npt.NDArray[np.uint32], npt.NDArray[np.uint32] | None]:
        """The turn's whole sequence: as sent, or the prompt held here since the plan plus the
        output sent alone (and then that prompt, which the sequence starts with). The
        fingerprint of a retry is the same either way."""
        policy = self._parts.policy
        if req.output_token_ids is None:
            # A prompt at PlanTurn's bound plus the answer stays committable.
            sent = checks.token_ids(
                req.token_ids, "token_ids", max_tokens=policy.max_prompt_tokens + policy.max_output_tokens
            )
            return sent, None
        if len(req.token_ids):
            raise InvalidArgument("output_token_ids", "set with token_ids; send one of the two")
        try:
            output = token_array(req.output_token_ids)
        except ValueError as exc:
            raise InvalidArgument("output_token_ids.token_ids", str(exc)) from exc
        if output.size > policy.max_output_tokens:
            raise InvalidArgument(
                "output_token_ids.token_ids", f"more than {policy.max_output_tokens} tokens"
            )
        prompt = self._parts.memory.held_prompt(state.turn_id)
        if prompt is None:
            raise FailedPrecondition(
                "this router replica does not hold the turn's prompt; send token_ids",
                reason=ErrorReason.PROMPT_NOT_HELD,
                metadata={"field": "output_token_ids"},
            )
        if not output.size:
            return prompt, prompt
        sequence = np.concatenate([prompt, output])
        sequence.flags.writeable = False  # the router's own: the chain cache keeps it uncopied
        return sequence, prompt

    async def _store(
        self,
        state: TurnState,
        tokens: np.ndarray[Any, Any],
        chain: Chain,
        params: dict[str, Any] | None,
        timer: CallTimer,
        turn_end: TurnEnd,
        transcript: TranscriptInfo | None,
    ) -> CommitResult:
        """Decode's retained KV, stored as the conversation's retention. Nothing is stored, and
        the commit still succeeds, when there is no conversation, decode kept nothing, its node
        is gone, or the registry will not store it (FailedPrecondition, NotFound) or does not
        answer (Unavailable)."""
        if not state.conversation or params is None:
            return _NOTHING_STORED
        if state.generation > MAX_GENERATION:  # the registry stores no later turn of it
            log.warning("commit.generation_exhausted", generation=state.generation)
            return _NOTHING_STORED
        bs = state.block_size
        if not len(chain):
            chain = self._parts.chains.chain(state.conversation, tokens, bs, root=state.chain_root)
        num_tokens = int(tokens.size)
        if isinstance(params.get("remote_num_tokens"), int):
            num_tokens = min(num_tokens, int(params["remote_num_tokens"]))
        # A retention's chain holds at most MAX_BLOCK_HASHES blocks (reached only by tiny blocks).
        num_tokens = min(num_tokens, len(block_groups(params)[0]) * bs, MAX_BLOCK_HASHES * bs)
        if num_tokens <= 0:
            return _NOTHING_STORED
        directory = self._parts.nodes
        try:
            nodes = {x.name: x for x in await self._registry(directory.nodes(state.model), timer)}
            if state.decode_node not in nodes:
                # Planned on a newer list than this replica's (a node that just registered).
                nodes = {x.name: x for x in await self._registry(directory.reread(state.model), timer)}
        except Unavailable as err:
            return _not_stored(err, state.decode_node)
        node = nodes.get(state.decode_node)
        if node is None:
            log.warning("commit.decode_node_gone", node=state.decode_node)
            return _NOTHING_STORED
        now = self._parts.clock.now()
        pin = now + self._parts.policy.decoder_kv_blocks_ttl_s - self._parts.policy.retention_margin_s
        new = NewRetention(
            request_id=f"{state.turn_id}-commit",
            conversation=state.conversation,
            node=node.name,
            generation=state.generation,
            model=state.model,
            block_size=bs,
            num_tokens=num_tokens,
            block_hashes=chain[: num_tokens // bs],
            kv_transfer_params=params,
            kv_bytes=num_tokens * node.kv_bytes_per_token,
            ttl=pin - now,
            pin_expire_at=pin,
            transcript=transcript,
            prompt_blocks=_prompt_blocks(state, num_tokens),
        )
        try:
            stored = await self._registry(self._parts.port.put_retention(new), timer)
        except Unavailable as err:
            return _not_stored(err, node.name)
        except Aborted as err:
            if state.reason == Reason.REGISTRY_UNAVAILABLE.value:
                # Planned without the registry, on a guessed generation: the newer turn stays.
                log.warning("commit.not_stored", reason=err.reason, node=node.name)
                return _NOTHING_STORED
            raise FailedPrecondition(
                "a turn of this generation or later was already committed", reason=ErrorReason.TURN_FINISHED
            ) from err
        except (FailedPrecondition, NotFound) as err:
            log.warning("commit.not_stored", reason=err.reason, node=node.name)
            return _NOTHING_STORED
        if self._parts.policy.token_granular_reuse and stored.num_tokens == num_tokens:
            stored = _with_answer_tokens(stored, tokens, state.prompt_tokens)
        self._parts.memory.hints.put(state.conversation, stored)
        if self._parts.shuttle is not None:
            self._parts.shuttle.committed(
                state.conversation,
                stored,
                kv_bytes=new.kv_bytes,
                pin_expire_at=pin,
                prefill_node=state.prefill_node,
                expected_think_time_s=state.expected_think_time_s,
                computed_tokens=state.prompt_tokens - max(state.reusable_tokens, state.local_hit_tokens),
                turn_end=turn_end,
            )
        return CommitResult(stored.name, stored.expire_at)

    def _observe(self, state: TurnState, t: TurnTimings) -> None:
        """The turn's measured prefill (and KV read) times, into the model's cost estimates."""
        cost = self._parts.costs.get(state.model)
        if cost is None or t.prefill_ms is None:
            return
        reused = state.reusable_tokens
        if state.decision == Decision.REUSE.value and t.remote_cached_tokens == 0:
            reused = 0  # prefill read nothing after all: it recomputed
        if reused and t.transfer_ms is not None and t.transfer_bytes:
            cost.observe_transfer(nbytes=t.transfer_bytes, measured_ms=t.transfer_ms)
        cached = max(reused, state.local_hit_tokens)
        read = max(reused - state.local_hit_tokens, 0)
        transfer = t.transfer_ms if t.transfer_ms is not None else (cost.transfer_ms(read) if read else 0.0)
        cost.observe_prefill(
            computed=state.prompt_tokens - cached,
            cached=cached,
            measured_ms=t.prefill_ms - transfer,
            node=state.prefill_node,
        )
        if t.ttft_ms is not None and state.decision != Decision.EXTEND.value:
            # Decode read the prompt's KV from prefill: all of it at most (less what its own
            # prefix cache held), so the fixed part learnt is, if anything, low.
            cost.observe_handoff(read_tokens=state.prompt_tokens, measured_ms=t.ttft_ms - t.prefill_ms)

    # ---- AbortTurn -------------------------------------------------------------------------

    async def abort_turn(self, handle: str, reason: str) -> None:
        timer = CallTimer()
        if len(reason) > 1024:
            raise InvalidArgument("reason", "longer than 1024 characters")
        state = self._unfinished(handle)
        # A turn planned without the registry holds nothing there, and its generation is a guess.
        if state.conversation and state.reason != Reason.REGISTRY_UNAVAILABLE.value:
            try:
                fence, _ = await self._registry(self._parts.port.get_conversation(state.conversation), timer)
            except Unavailable as err:
                if err.reason != ErrorReason.REGISTRY_UNAVAILABLE:
                    raise
                log.warning("abort.fence_unknown", reason=err.reason)  # aborted here all the same
            else:
                if fence >= state.generation:
                    raise FailedPrecondition("turn already committed", reason=ErrorReason.TURN_FINISHED)
        if state.claimed:
            await timer.registry(self._release(state, "abort"))
        self._finish(state, "aborted")
        log.info("turn.aborted", reason=reason[:200], claimed=log_name(state.claimed))
        self._parts.metrics.own_abort.observe(timer.own_cpu_s())

    async def _registry(self, call: Awaitable[T], timer: CallTimer) -> T:
        """A registry call of a commit or an abort, waited for at most commit_registry_timeout_s
        (then Unavailable, REGISTRY_UNAVAILABLE, as when the registry cannot be reached, while
        the call itself goes on and lands if it can)."""
        task = asyncio.ensure_future(call)
        try:
            return await timer.registry(
                asyncio.wait_for(asyncio.shield(task), self._parts.policy.commit_registry_timeout_s)
            )
        except TimeoutError as err:
            self._landing.add(task)
            task.add_done_callback(self._landed)
            raise Unavailable(
                f"the registry did not answer within {self._parts.policy.commit_registry_timeout_s} s",
                reason=ErrorReason.REGISTRY_UNAVAILABLE,
            ) from err

    def _landed(self, task: asyncio.Future[Any]) -> None:
        self._landing.discard(task)
        if not task.cancelled() and (err := task.exception()) is not None:
            # The reason only: an error's message may name the conversation (tenant data).
            log.info("commit.late_call_failed", reason=getattr(err, "reason", type(err).__name__))

    async def _end_claim(self, state: TurnState, result: CommitResult, timer: CallTimer) -> None:
        """The committed turn's claim, ended: by the put that replaced the claimed retention,
        else released here (a fork's put went to its own conversation). A found history that
        forks read (superseded_parent) is removed once the last of them stored its own."""
        if not state.claimed or (result.retention and state.claimed.startswith(f"{state.conversation}/")):
            return
        if result.not_stored == "registry_unavailable":
            log.warning(
                "commit.release_failed",
                reason=ErrorReason.REGISTRY_UNAVAILABLE,
                retention=log_name(state.claimed),
            )
            return
        await timer.registry(self._release(state, "commit"))
        if state.superseded_parent and result.retention:
            try:  # refused while another fork's shared claim reads it: the last one removes it
                await timer.registry(
                    self._registry(self._parts.port.release(state.claimed, claim_id=""), CallTimer())
                )
                structlog.contextvars.bind_contextvars(superseded_parent="removed")
            except (FailedPrecondition, Unavailable) as err:
                structlog.contextvars.bind_contextvars(superseded_parent=str(err.reason).lower())

    async def _release(self, state: TurnState, rpc: str) -> None:
        """Release the retention the turn claimed. Best effort when the registry does not answer:
        logged, and the claim lapses on its own TTL (removing the retention: a claim is never
        handed back)."""
        try:
            await self._registry(
                self._parts.port.release(state.claimed, claim_id=state.claim_id), CallTimer()
            )
        except Unavailable as err:
            if err.reason != ErrorReason.REGISTRY_UNAVAILABLE:
                raise
            log.warning(f"{rpc}.release_failed", reason=err.reason, retention=log_name(state.claimed))


def _with_answer_tokens(
    retention: RetentionInfo, tokens: npt.NDArray[np.uint32], prompt_tokens: int
) -> RetentionInfo:
    """The retention with the tokens of its answer's blocks, for the next plan's token-granular
    cut: from the block holding the prompt's end (the first with generated tokens) to the
    retention's end, at most MAX_KNOWN_BLOCKS blocks. A longer answer keeps its last blocks:
    a tool call ends it, and an unchanged history goes on past its last token."""
    bs, n = retention.block_size, retention.num_tokens
    first = max(min(prompt_tokens, n) // bs, -(-n // bs) - MAX_KNOWN_BLOCKS)
    # A copy: a view would keep the whole commit's array alive past the hint's byte bound.
    return replace(retention, known_from_block=first, known_tokens=tokens[first * bs : n].copy())


def _prompt_blocks(state: TurnState, num_tokens: int) -> int:
    """The leading blocks the registry also finds the retention by: the prompt's full blocks but
    the last one before its last token (re-tokenizing a chat changes the tokens where the
    generation prompt meets the answer, up to a few before the prompt's end; which block the
    retention is found by costs no reuse: the plan verifies the prompt token by token). 0 when
    the prompt's blocks are not in the retention's block size."""
    if not state.prompt_full_blocks:
        return 0
    return max(0, min((state.prompt_tokens - 1) // state.block_size - 1, num_tokens // state.block_size))


def _not_stored(err: Unavailable, node: str) -> CommitResult:
    """A commit whose registry calls failed: nothing stored, the commit goes on."""
    if err.reason != ErrorReason.REGISTRY_UNAVAILABLE:
        raise err
    log.warning("commit.not_stored", reason=err.reason, node=node)
    return _REGISTRY_UNAVAILABLE


def _check_decode_node(params: dict[str, Any], state: TurnState) -> None:
    """Decode's params must name the decode node the turn was planned on, as registered (its
    engine id and NIXL side channel): they become the retention readers are sent to.
    FailedPrecondition (NODE_MISMATCH) naming the first param that does not."""
    expected: list[tuple[str, object]] = [("remote_engine_id", state.decode_engine_id)]
    if state.decode_side_channel_host:  # handles issued before it was recorded carry none
        expected += [
            ("remote_host", state.decode_side_channel_host),
            ("remote_port", state.decode_side_channel_port),
        ]
    for key, value in expected:
        if params.get(key) != value:
            raise FailedPrecondition(
                f"decode_kv_transfer_params.{key} is not the planned decode node {state.decode_node}'s",
                reason=ErrorReason.NODE_MISMATCH,
                metadata={"field": f"decode_kv_transfer_params.{key}", "node": state.decode_node},
            )


def _describe(span: trace.Span, state: TurnState, retention: str, t: TurnTimings) -> None:
    """The commit's attributes on its span (not built for a span nobody records)."""
    if not span.is_recording():
        return
    span.set_attributes(
        {
            "kvshuttle.turn_index": state.generation,
            "kvshuttle.decision": state.decision,
            "kvshuttle.decision.reason": state.reason,
            "kvshuttle.reused_tokens": state.reusable_tokens,
            "kvshuttle.recomputed_tokens": state.prompt_tokens
            - max(state.reusable_tokens, state.local_hit_tokens),
            "kvshuttle.retention": log_name(retention),
            **({"kvshuttle.ttft.ms": t.ttft_ms} if t.ttft_ms is not None else {}),
            **({"kvshuttle.transfer.ms": t.transfer_ms} if t.transfer_ms is not None else {}),
            **({"kvshuttle.transfer.bytes": t.transfer_bytes} if t.transfer_bytes is not None else {}),
        }
    )


def _trace_parent(state: TurnState) -> Any:
    """The plan's trace, when the caller did not send one: a turn stays one trace."""
    current = trace.get_current_span().get_span_context()
    if current.is_valid and format(current.trace_id, "032x") == state.trace_id:
        return None
    try:
        ctx = trace.SpanContext(
            int(state.trace_id, 16),
            int(state.span_id, 16),
            is_remote=True,
            trace_flags=trace.TraceFlags(
                trace.TraceFlags.SAMPLED if state.trace_sampled else trace.TraceFlags.DEFAULT
            ),
        )
    except ValueError:
        return None
    return trace.set_span_in_context(trace.NonRecordingSpan(ctx)) if ctx.is_valid else None
