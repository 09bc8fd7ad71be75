"""The sender generation token: one sender lifetime of an external id (docs/protocol.md §4.5).

The token's fields change only in the named methods below, each of which asserts its
precondition. :class:`~omnirelay.transfer.sender.SendSide` calls them under its lock and
acts on what they return (the lock holder decides whether the token is still *current*,
i.e. still the map's token for its external id).

=====================================  =============================================  =========================================
event                                  precondition                                   method / effect
=====================================  =============================================  =========================================
first admitted chunk                   no token                                       ``SenderGeneration(...)``
admit (terminal sets the fence)        ¬cancelled ∧ ¬failed ∧ no terminal yet         :meth:`admit`
task start                             current ∧ ¬failed ∧ (terminal ∨ ¬cancelled)    :meth:`may_run` then :meth:`start`
before put                             in flight                                      :meth:`before_put`: ``num_puts = sent+1``
put ok                                 in flight                                      :meth:`put_succeeded` (terminal_sent;
                                                                                      counter += 1 unless a cancelled non-
                                                                                      terminal without a pending terminal)
put failed / raised / processor        in flight                                      :meth:`fail` (vetoes every later task)
cancel (``cleanup_sender``)            –                                              :meth:`cancel` → DEFER / WAIT / RETIRE
terminal task ends (any path)          terminal admitted                              :meth:`end_terminal` → run deferred?
any task ``finally``                   –                                              :meth:`end_task` → retire?
retire                                 ¬in_flight ∧ ¬terminal_pending                 :meth:`keys_to_clean` (exact count)
=====================================  =============================================  =========================================

A failed generation is not retired by its own task: it stays (refusing admissions) until
the scheduler, told by the failure record, cleans the request. That keeps a later chunk of
the same request from starting a new generation at chunk 0.
"""

from __future__ import annotations

import enum

__all__ = ["CancelAction", "SenderGeneration"]


class CancelAction(enum.Enum):
    #: A terminal is still queued or running: the terminal's end runs the cleanup again.
    DEFER = "defer"
    #: A task is in flight: its ``finally`` retires the token.
    WAIT = "wait"
    #: Nothing runs: retire now (clean its keys, drop it, clear the maps).
    RETIRE = "retire"


class SenderGeneration:
    """One generation of an external id on this sender. Compared by identity, never by id."""

    __slots__ = (
        "cancelled",
        "cleanup_deferred",
        "external_id",
        "has_failed",
        "in_flight",
        "internal_id",
        "is_terminal_admitted",
        "num_puts",
        "num_sent",
        "segment_generation",
        "terminal_pending",
        "terminal_sent",
        "to_replica",
        "watermark",
    )

    def __init__(self, external_id: str, internal_id: str, to_replica: int = 0) -> None:
        self.external_id = external_id
        self.internal_id = internal_id
        #: the replica of the next stage this request is bound to (its chunks' notices go there)
        self.to_replica = to_replica
        self.in_flight = False
        self.cancelled = False
        self.terminal_pending = False
        self.cleanup_deferred = False
        #: Keys this generation may have created (0..num_puts-1): set *before* each put.
        self.num_puts = 0
        self.terminal_sent = False
        self.has_failed = False
        self.is_terminal_admitted = False
        #: The put counter: successful, honored puts; the next key's chunk id.
        self.num_sent = 0
        #: Committed-token watermark (preemption dedupe, docs/protocol.md §4.3 step 3).
        self.watermark: int | None = None
        self.segment_generation = 0

    def __repr__(self) -> str:
        flags = [n for n in ("in_flight", "cancelled", "terminal_pending", "cleanup_deferred",
                             "terminal_sent", "has_failed") if getattr(self, n)]  # fmt: skip
        return (
            f"SenderGeneration({self.external_id!r}, internal={self.internal_id!r}, "
            f"num_puts={self.num_puts}, num_sent={self.num_sent}, {'|'.join(flags) or 'idle'})"
        )

    @property
    def is_active(self) -> bool:
        """Accepts chunks: not cancelled, not failed (SPEC ``has_active_sender``)."""
        return not self.cancelled and not self.has_failed

    def admit(self, *, is_terminal: bool, is_segment_end: bool, confirmed: int | None) -> None:
        assert self.is_active and not self.is_terminal_admitted, f"admit on {self!r}"
        if is_terminal:
            self.is_terminal_admitted = True
            self.terminal_pending = True
        if is_segment_end:
            self.segment_generation += 1
            self.watermark = None
        elif confirmed is not None:
            self.watermark = confirmed

    def may_run(self, *, is_terminal: bool) -> bool:
        """Cancellation does not veto the terminal (downstream's end of stream); failure does."""
        return not self.has_failed and (is_terminal or not self.cancelled)

    def start(self) -> None:
        # Invariant: tasks of one external id run serially (one lane), so one in flight at most.
        assert not self.in_flight, f"start on {self!r}"
        self.in_flight = True

    def before_put(self) -> int:
        """Count the key about to be put, so cleanup covers it whatever the put does."""
        assert self.in_flight, f"before_put on {self!r}"
        self.num_puts = self.num_sent + 1
        return self.num_sent

    def put_succeeded(self, *, is_terminal: bool) -> bool:
        """Apply a successful put; returns whether it was honored (the counter advanced)."""
        assert self.in_flight, f"put_succeeded on {self!r}"
        if is_terminal:
            self.terminal_sent = True
        honored = not (self.cancelled and not is_terminal and not self.terminal_pending)
        if honored:
            self.num_sent += 1
        return honored

    def fail(self) -> None:
        self.has_failed = True

    def cancel(self) -> CancelAction:
        self.cancelled = True
        if self.terminal_pending:
            self.cleanup_deferred = True
            return CancelAction.DEFER
        if self.in_flight:
            return CancelAction.WAIT
        return CancelAction.RETIRE

    def end_terminal(self) -> bool:
        """Release the terminal fence; returns whether a deferred cleanup must run now."""
        assert self.terminal_pending, f"end_terminal on {self!r}"
        self.terminal_pending = False
        deferred, self.cleanup_deferred = self.cleanup_deferred, False
        return deferred

    def end_task(self) -> bool:
        """Any task's ``finally``; returns whether the token must be retired now."""
        self.in_flight = False
        return self.cancelled and not self.terminal_pending

    def keys_to_clean(self) -> int:
        """How many exact keys (0..n-1) the retiring generation must clean.

        A successful terminal is never cleaned by the sender (downstream still needs it);
        a failed terminal is (its key is counted in ``num_puts``).
        """
        assert not self.in_flight and not self.terminal_pending, f"keys_to_clean on {self!r}"
        return 0 if self.terminal_sent else self.num_puts
