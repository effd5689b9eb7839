"""The watchdog's pure rules: learned deadlines, stragglers, the breaker, exit classes."""

from __future__ import annotations

import pytest

from hpc_elastic.agent.watchdog import (
    DEFAULT_RULES,
    Breaker,
    DeadlineRule,
    Deadlines,
    ExitClass,
    Hung,
    Phase,
    RankWatch,
    StragglerRule,
    Stragglers,
    arrival_lags,
    checkpoints_at_restarts,
    classify_exit,
    learned_deadline,
    paced_step_times,
    percentile,
    step_seconds,
    user_error_sentence,
)
from hpc_elastic.events import Event, kind_of


def past_deadline(phase: Phase, waited: float, deadlines: Deadlines) -> bool:
    """The watchdog's own rule (``Hung.past_deadline``) for a rank that waited ``waited``."""
    return Hung(0, phase, waited, deadlines.deadline(phase)).past_deadline


RULE = DeadlineRule(initial=600.0, floor=10.0, percentile=99.0, factor=5.0, min_samples=5)


def test_the_percentile_is_an_observed_value_by_nearest_rank() -> None:
    samples = [float(n) for n in range(1, 101)]
    assert percentile(samples, 99.0) == 99.0
    assert percentile(samples, 50.0) == 50.0
    assert percentile([3.0], 99.0) == 3.0
    assert percentile([1.0, 1.0, 1.0, 9.0], 99.0) == 9.0


def test_the_percentile_of_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="no samples"):
        percentile([], 99.0)


def test_before_enough_samples_the_deadline_is_the_generous_initial_one() -> None:
    assert learned_deadline([1.0, 1.0, 1.0, 1.0], RULE) == 600.0


def test_a_learned_deadline_is_the_high_percentile_times_the_factor() -> None:
    samples = [2.0] * 98 + [3.0, 4.0]
    assert learned_deadline(samples, RULE) == 15.0


def test_a_learned_deadline_never_drops_below_the_floor() -> None:
    assert learned_deadline([0.1] * 50, RULE) == 10.0


def test_hang_timeout_overrides_whatever_was_learned() -> None:
    assert learned_deadline([2.0] * 50, RULE, override=4.0) == 4.0
    assert learned_deadline([], RULE, override=4.0) == 4.0


def test_deadlines_are_learned_per_phase_and_ignore_nonsense_durations() -> None:
    deadlines = Deadlines(rules={**DEFAULT_RULES, Phase.STEP: RULE})
    for _ in range(10):
        deadlines.observe(Phase.STEP, 4.0)
    deadlines.observe(Phase.STEP, -1.0)
    deadlines.observe(Phase.STEP, float("nan"))
    assert deadlines.samples(Phase.STEP) == [4.0] * 10
    assert deadlines.deadline(Phase.STEP) == 20.0
    assert deadlines.deadline(Phase.CHECKPOINT) == DEFAULT_RULES[Phase.CHECKPOINT].initial
    assert past_deadline(Phase.STEP, 20.5, deadlines)
    assert not past_deadline(Phase.STEP, 19.5, deadlines)


def test_one_start_up_teaches_the_start_up_deadline() -> None:
    deadlines = Deadlines()
    deadlines.observe(Phase.STARTUP, 100.0)
    assert deadlines.deadline(Phase.STARTUP) == 500.0


def test_the_default_step_floor_is_far_above_a_loaded_machines_hiccups() -> None:
    deadlines = Deadlines()
    for _ in range(100):
        deadlines.observe(Phase.STEP, 0.05)
    deadlines.observe(Phase.STEP, 4.0)
    assert not past_deadline(Phase.STEP, 30.0, deadlines)


def test_a_rank_slower_than_k_times_the_median_for_m_steps_is_a_straggler_once() -> None:
    stragglers = Stragglers(StragglerRule(factor=1.5, consecutive=3))
    times = {0: 1.0, 1: 1.0, 2: 1.1, 3: 2.0}
    assert stragglers.observe(times) == []
    assert stragglers.observe(times) == []
    assert stragglers.observe(times) == [3]
    assert stragglers.observe(times) == []


def test_a_rank_that_catches_up_starts_counting_again() -> None:
    stragglers = Stragglers(StragglerRule(factor=1.5, consecutive=2))
    slow = {0: 1.0, 1: 1.0, 2: 3.0}
    fast = {0: 1.0, 1: 1.0, 2: 1.0}
    assert stragglers.observe(slow) == []
    assert stragglers.observe(fast) == []
    assert stragglers.observe(slow) == []
    assert stragglers.observe(slow) == [2]


def test_a_reported_straggler_is_forgiven_only_after_as_many_fast_steps_in_a_row() -> None:
    """One fast sample among slow ones (the others slowed by load) once reported the same
    straggler twice in 10 s (tests/agent/test_agent_watchdog.py in a loaded CI run)."""
    stragglers = Stragglers(StragglerRule(factor=1.5, consecutive=2))
    slow = {0: 1.0, 1: 1.0, 2: 3.0}
    fast = {0: 1.0, 1: 1.0, 2: 1.0}
    assert [stragglers.observe(slow) for _ in range(2)] == [[], [2]]
    assert stragglers.observe(fast) == []
    assert [stragglers.observe(slow) for _ in range(3)] == [[], [], []]
    assert [stragglers.observe(fast) for _ in range(2)] == [[], []]  # forgiven
    assert [stragglers.observe(slow) for _ in range(2)] == [[], [2]]


def test_with_two_ranks_nobody_is_called_a_straggler() -> None:
    stragglers = Stragglers(StragglerRule(consecutive=1))
    assert stragglers.observe({0: 1.0, 1: 10.0}) == []


def test_the_straggler_score_is_the_step_time_over_the_median() -> None:
    assert Stragglers().score({0: 1.0, 1: 1.0, 2: 2.0}) == {0: 1.0, 1: 1.0, 2: 2.0}


def test_a_heartbeat_gives_seconds_per_step_once_the_step_moves() -> None:
    assert step_seconds(None, (10.0, 5)) is None
    assert step_seconds((10.0, 5), (11.0, 5)) is None
    assert step_seconds((10.0, None), (11.0, 6)) is None
    assert step_seconds((10.0, 5), (12.0, 9)) == 0.5


def test_the_breaker_trips_after_n_restarts_without_a_new_checkpoint() -> None:
    breaker = Breaker(limit=5)
    assert breaker.tripped([800, 1200, 1200, 1200, 1200]) is None
    sentence = breaker.tripped([800, 1200, 1200, 1200, 1200, 1200])
    assert sentence is not None
    assert "restarted 5 times since step 1200 without progress" in sentence


def test_a_new_checkpoint_resets_the_breaker() -> None:
    breaker = Breaker(limit=3)
    assert breaker.tripped([100, 100, 100, 200]) is None
    assert breaker.tripped([]) is None


def test_the_breaker_names_a_job_that_never_checkpointed() -> None:
    sentence = Breaker(limit=2).tripped([None, None])
    assert sentence is not None
    assert "since the start (no checkpoint yet)" in sentence


TRACEBACK = """Traceback (most recent call last):
  File "train.py", line 1, in <module>
    import tochvision
ModuleNotFoundError: No module named 'tochvision'
"""


@pytest.mark.parametrize(
    ("exit_code", "message", "expected"),
    [
        (1, TRACEBACK, ExitClass.USER_ERROR),
        (1, "ImportError: cannot import name 'x' from 'y'", ExitClass.USER_ERROR),
        (1, '  File "t.py", line 3\nSyntaxError: invalid syntax', ExitClass.USER_ERROR),
        (2, "usage: train.py [-h] --lr LR", ExitClass.USER_ERROR),
        (1, "RuntimeError: CUDA error: an illegal memory access", ExitClass.RETRY),
        (1, "torch.OutOfMemoryError: CUDA out of memory", ExitClass.RETRY),
        (None, TRACEBACK, ExitClass.RETRY),
        (1, "raise RuntimeError('wrapped ImportError: x')", ExitClass.RETRY),
    ],
)
def test_only_user_errors_are_not_retried(
    exit_code: int | None, message: str, expected: ExitClass
) -> None:
    assert classify_exit(exit_code, message) is expected


def test_the_user_error_sentence_names_the_rank_and_the_exception() -> None:
    sentence = user_error_sentence(3, 1, TRACEBACK)
    assert sentence.startswith("Worker rank 3 failed with ModuleNotFoundError")
    assert user_error_sentence(0, 2, "usage: x").count("exit code 2") == 1


def watch(step_rule: DeadlineRule = RULE) -> RankWatch:
    deadlines = Deadlines(rules={**DEFAULT_RULES, Phase.STEP: step_rule})
    return RankWatch(deadlines, Stragglers(StragglerRule(factor=1.5, consecutive=2)), started=0.0)


def test_a_script_that_never_beats_is_never_killed_for_silence() -> None:
    rank_watch = watch()
    assert rank_watch.poll(1e9, {0: None, 1: None}).hung == []


def test_once_start_up_is_learned_a_rank_that_never_beats_is_hung_past_its_deadline() -> None:
    rank_watch = watch()
    rank_watch.deadlines.observe(Phase.STARTUP, 100.0)
    assert rank_watch.poll(499.0, {0: None}).hung == []
    [hung] = rank_watch.poll(501.0, {0: None}).hung
    assert (hung.rank, hung.phase, hung.deadline) == (0, Phase.STARTUP, 500.0)
    assert hung.sentence(overridden=False) == (
        "Rank 0 made no progress for 501.0 s in startup (learned deadline 500.0 s) and was killed."
    )


def test_hang_timeout_never_shortens_start_up() -> None:
    deadlines = Deadlines(override=4.0)
    deadlines.observe(Phase.STARTUP, 100.0)
    assert deadlines.deadline(Phase.STARTUP) == 500.0
    assert deadlines.deadline(Phase.STEP) == 4.0
    assert deadlines.deadline(Phase.CHECKPOINT) == 4.0


def test_the_watch_learns_step_gaps_and_catches_a_rank_that_stops() -> None:
    rank_watch = watch()
    for second in range(1, 12):
        verdict = rank_watch.poll(
            second + 0.1, {0: (float(second), second), 1: (float(second), second)}
        )
        assert verdict.hung == []
    assert rank_watch.deadlines.samples(Phase.STARTUP) == [1.0, 1.0]
    assert rank_watch.deadlines.deadline(Phase.STEP) == RULE.floor
    still = {0: (11.0, 11), 1: (11.0, 11)}
    assert rank_watch.poll(11.0 + RULE.floor - 0.5, still).hung == []
    hung = rank_watch.poll(11.0 + RULE.floor + 0.5, still).hung
    assert [(h.rank, h.phase) for h in hung] == [(0, Phase.STEP), (1, Phase.STEP)]


def test_while_a_checkpoint_is_written_the_checkpoint_deadline_applies() -> None:
    rank_watch = watch()
    for second in range(1, 8):
        rank_watch.poll(second + 0.1, {0: (float(second), second)})
    waited = 7.0 + RULE.floor + 1.0
    assert rank_watch.poll(waited, {0: (7.0, 7)}, checkpointing=True).hung == []
    assert [h.phase for h in rank_watch.poll(waited, {0: (7.0, 7)}).hung] == [Phase.STEP]


def test_the_watch_reports_a_rank_that_keeps_stepping_slower_than_the_others() -> None:
    rank_watch = watch()
    found: list[int] = []
    for beat in range(1, 6):
        readings = {rank: (float(beat), beat * 10) for rank in range(3)}
        readings[3] = (float(beat), beat * 4)  # 2.5 times slower per step
        verdict = rank_watch.poll(beat + 0.1, readings)
        found += verdict.stragglers
    assert found == [3]
    assert verdict.scores[3] == pytest.approx(2.5)


def test_the_breaker_reads_its_history_from_the_shared_events_counting_each_round_once() -> None:
    def at(time: float, kind: str, round: int | None = None, **details: object) -> Event:
        return Event(
            kind=kind_of(kind), slot="0", node="n", round=round, details=details, time=time
        )

    recorded = [
        at(1, "failure", 1),  # before any checkpoint
        at(1.5, "restart", 1),
        at(2, "checkpoint", 2, step=1200),
        at(3, "failure", 2),
        at(3.1, "failure", 2, slot="1"),  # another node's root cause, same round
        at(3.5, "restart", 3, reason="membership or job changed"),  # churn does not count
        at(4, "checkpoint", 4, step=800),  # an older step committed late changes nothing
        at(5, "failure", 4),
        at(9, "failure", 5),
    ]
    assert checkpoints_at_restarts(reversed(recorded)) == [None, 1200, 1200, 1200]
    sentence = Breaker(limit=3).tripped(checkpoints_at_restarts(recorded))
    assert sentence is not None
    assert "restarted 3 times since step 1200 without progress" in sentence


def test_in_lockstep_the_rank_that_keeps_arriving_last_is_the_straggler() -> None:
    """Every rank steps once a second (a collective per step), but rank 2 reaches each step's
    collective 0.6 s after the others, which wait for it: the step times are equal, the
    arrival lag is what tells it apart."""
    rank_watch = watch()
    found: list[int] = []
    for step in range(1, 8):
        readings = {rank: (float(step), step) for rank in range(3)}
        readings[2] = (step + 0.6, step)
        verdict = rank_watch.poll(step + 0.7, readings)
        found += verdict.stragglers
    assert found == [2]
    assert verdict.scores[2] == pytest.approx(1.6)


def test_in_lockstep_without_a_late_rank_nobody_straggles() -> None:
    rank_watch = watch()
    for step in range(1, 20):
        readings = {rank: (step + 0.01 * rank, step) for rank in range(3)}
        assert rank_watch.poll(step + 0.5, readings).stragglers == []


def test_arrival_lags_come_from_the_newest_step_every_rank_reached() -> None:
    arrivals = {0: {4: 10.0, 5: 11.0}, 1: {4: 10.2, 5: 11.5}, 2: {4: 10.1}}
    assert arrival_lags(arrivals) == pytest.approx({0: 0.0, 1: 0.2, 2: 0.1})
    assert arrival_lags({0: {1: 1.0}, 1: {2: 2.0}}) == {}
    drifted = {0: {4: 10.0, 9: 15.0}, 1: {4: 12.0}}  # independent ranks: no lockstep
    assert arrival_lags(drifted) == {}
    assert paced_step_times({0: 1.0, 1: 1.0}, {0: {1: 1.0}, 1: {1: 1.4}}) == pytest.approx(
        {0: 1.0, 1: 1.4}
    )


# --- deadlines under load (docs/reliability.md, "Deadlines under load") ---------------------


def learned(rank_watch: RankWatch, ranks: int = 2, queued: float = 0.0) -> dict[int, float]:
    """Ten steps a second apart on every rank, then silence from step 11 on; each rank's
    CPU-queue seconds so far (``queued`` at every step)."""
    waits = dict.fromkeys(range(ranks), queued)
    for second in range(1, 12):
        readings = {rank: (float(second), second) for rank in range(ranks)}
        rank_watch.poll(second + 0.1, readings, queued=waits)
    assert rank_watch.deadlines.deadline(Phase.STEP) == RULE.floor
    return waits


def test_time_a_rank_spent_waiting_for_a_cpu_is_not_held_against_it() -> None:
    """Rank 1 spins in a step that a busy machine runs one second in three: it waited for a
    CPU two thirds of the time, so it has not used up its deadline yet. Rank 0, which
    sleeps (a stopped rank, a rank waiting in a collective), has."""
    rank_watch = watch()
    learned(rank_watch)
    still = {0: (11.0, 11), 1: (11.0, 11)}
    after = 11.0 + RULE.floor + 3.0
    verdict = rank_watch.poll(after, still, queued={0: 0.0, 1: (RULE.floor + 3.0) * 2 / 3})
    assert [hung.rank for hung in verdict.hung] == [0]
    assert verdict.waits[1].waited == pytest.approx(RULE.floor + 3.0)
    assert verdict.waits[1].counted == pytest.approx((RULE.floor + 3.0) / 3)
    # A rank that spins for ever is still caught, later: it gets its share of a CPU.
    later = 11.0 + 3 * RULE.floor + 3.0
    verdict = rank_watch.poll(later, still, queued={0: 0.0, 1: (3 * RULE.floor + 3.0) * 2 / 3})
    assert [hung.rank for hung in verdict.hung] == [0, 1]


def test_a_poll_that_comes_late_does_not_count_against_the_ranks() -> None:
    """The agent itself was not scheduled for most of the wait: the machine is busy."""
    deadlines = Deadlines(rules={**DEFAULT_RULES, Phase.STEP: RULE})
    rank_watch = RankWatch(deadlines, Stragglers(), started=0.0, poll_interval=0.1)
    for tenth in range(10, 120):
        second = tenth / 10
        rank_watch.poll(second, {0: (float(int(second)), int(second))})
    stalled = 11.9 + 0.1 + RULE.floor  # the next poll comes a whole floor late
    [wait] = rank_watch.poll(stalled, {0: (11.0, 11)}).waits.values()
    assert not wait.past_deadline
    assert wait.counted == pytest.approx(stalled - 11.0 - RULE.floor)
    # Polled on time from then on, the rank is caught a floor after its last beat, less the
    # stall: the wait goes on counting.
    now = stalled
    while not rank_watch.poll(now, {0: (11.0, 11)}).hung:
        now = round(now + 0.1, 6)
        assert now < stalled + RULE.floor, "never caught"


def test_an_investigation_that_found_the_job_moving_excuses_the_wait_so_far() -> None:
    rank_watch = watch()
    learned(rank_watch)
    still = {0: (11.0, 11), 1: (11.0, 11)}
    assert rank_watch.poll(11.0 + RULE.floor + 1.0, still).hung
    rank_watch.excuse(11.0 + RULE.floor + 1.0)
    verdict = rank_watch.poll(11.0 + 2 * RULE.floor, still)
    assert verdict.hung == []
    assert verdict.waits[0].waited == 2 * RULE.floor, "the evidence counts from the last beat"
    assert rank_watch.poll(11.0 + 2 * RULE.floor + 2.0, still).hung


def test_a_rank_late_only_for_want_of_a_cpu_is_not_a_straggler() -> None:
    """In lockstep, rank 2 arrives 0.6 s late at every step, but it spent those 0.6 s in the
    CPU's run queue (the machine is busy): not its fault, not a straggler. Rank 3 of another
    run arrives as late without queueing: it is one."""
    for queues, expected in ((True, []), (False, [2])):
        rank_watch = watch()
        found: list[int] = []
        for step in range(1, 8):
            readings = {rank: (float(step), step) for rank in range(3)}
            readings[2] = (step + 0.6, step)
            queued = {0: 0.0, 1: 0.0, 2: 0.6 * step if queues else 0.0}
            found += rank_watch.poll(step + 0.7, readings, queued=queued).stragglers
        assert found == expected


def test_when_every_rank_is_slow_none_is_a_straggler() -> None:
    """The machine got three times slower for everyone: the median moved with them."""
    rank_watch = watch()
    found: list[int] = []
    for step in range(1, 30):
        pace = 1.0 if step < 10 else 3.0
        at = 9.0 + (step - 9) * pace if step >= 10 else float(step)
        readings = {rank: (at + 0.01 * rank, step) for rank in range(3)}
        found += rank_watch.poll(at + 0.5, readings).stragglers
    assert found == []


def test_the_queue_time_of_a_step_comes_off_its_paced_time() -> None:
    paced = paced_step_times({0: 1.0, 1: 1.0}, {0: {1: 1.0}, 1: {1: 1.4}}, {1: 0.4})
    assert paced == pytest.approx({0: 1.0, 1: 1.0})


def test_the_watch_reports_the_cpu_a_rank_used_since_its_step_and_what_a_step_takes() -> None:
    rank_watch = watch()
    for second in range(1, 12):  # 10 ms of CPU per step
        rank_watch.poll(second + 0.1, {0: (float(second), second)}, ran={0: 0.01 * second})
    verdict = rank_watch.poll(14.0, {0: (11.0, 11)}, ran={0: 0.11 + 1.5})  # then it spins
    assert verdict.waits[0].cpu == pytest.approx(1.5)
    assert verdict.waits[0].cpu_per_step == pytest.approx(0.01)
