"""The N/I chunk plan: order, anchors, discarded anchor predictions, final timeline, emissions."""

from __future__ import annotations

import pytest

from pipeline.schedule import ChunkKind, ChunkPlan, PlanError, frames_for_audio


def names(plan: ChunkPlan) -> list[str]:
    return [s.name for s in plan.steps]


def test_execution_order_matches_the_write_up() -> None:
    plan = ChunkPlan(num_frames=16 * 5, chunk_frames=16, context_frames=4, interp_frames=4)
    assert names(plan) == ["N0", "N1", "I0", "N2", "I1", "N3", "I2", "N4", "I3"]


def test_i_chunk_anchors_and_span() -> None:
    L, C, e = 16, 4, 4
    plan = ChunkPlan(L * 3, L, C, e)
    steps = {s.name: s for s in plan.steps}
    i0 = steps["I0"]
    # anchors: last frame of N0 and frame e of N1
    assert i0.known == (L - 1, L + e)
    assert i0.window == range(L - 1, L + e + 1)
    # generated: the e frames between the anchors; anchor predictions are not kept
    assert i0.generate == range(L, L + e)
    assert i0.known[0] not in i0.generate and i0.known[1] not in i0.generate
    assert i0.known_mask() == [True] + [False] * e + [True]


def test_n_chunks_see_last_c_frames_of_previous_n_as_context() -> None:
    L, C, e = 16, 4, 4
    plan = ChunkPlan(L * 3, L, C, e)
    steps = {s.name: s for s in plan.steps}
    assert steps["N0"].known == () and steps["N0"].window == range(0, L)
    n2 = steps["N2"]
    assert n2.known == tuple(range(2 * L - C, 2 * L))
    assert n2.generate == range(2 * L, 3 * L)
    assert n2.window == range(2 * L - C, 3 * L)


@pytest.mark.parametrize("num_frames", [1, 2, 15, 16, 17, 20, 21, 31, 32, 33, 47, 48, 100, 1001])
@pytest.mark.parametrize("L,C,e", [(16, 4, 4), (8, 2, 1), (5, 5, 4), (2, 0, 1)])
def test_final_timeline_tiles_every_frame_once_in_order(num_frames: int, L: int, C: int, e: int) -> None:
    plan = ChunkPlan(num_frames, L, C, e)
    emitted: list[int] = []
    generated: dict[int, str] = {}
    done: set[str] = set()
    for step in plan.steps:
        # dependencies: I_k after N_k and N_{k+1}; N_k after N_{k-1}
        if step.kind is ChunkKind.I:
            assert {f"N{step.index}", f"N{step.index + 1}"} <= done
        elif step.index > 0:
            assert f"N{step.index - 1}" in done
        done.add(step.name)
        for t in step.generate:
            generated[t] = step.name  # later steps (I chunks) replace earlier predictions
        if step.emission is not None:
            em = step.emission
            assert em.frames == range(em.index * L, min((em.index + 1) * L, num_frames))
            assert list(em.frames) == list(em.from_step) + list(em.from_pending)
            assert set(em.from_step) <= set(step.generate)
            for t in em.from_step:
                assert generated[t] == step.name
            for t in em.from_pending:  # the rest of the pending N chunk, after the I chunk's span
                assert generated[t] == f"N{em.index}"
            emitted.extend(em.frames)
    assert emitted == list(range(num_frames))
    assert [s.emission.index for s in plan.steps if s.emission] == list(range(plan.num_emissions))


def test_final_timeline_sources() -> None:
    L, e = 16, 4
    plan = ChunkPlan(L * 3, L, 4, e)
    sources = [(s.name, s.emission.from_step, s.emission.from_pending) for s in plan.steps if s.emission]
    assert sources == [
        ("N0", range(0, L), range(L, L)),
        ("I0", range(L, L + e), range(L + e, 2 * L)),
        ("I1", range(2 * L, 2 * L + e), range(2 * L + e, 3 * L)),
    ]


def test_emission_follows_n0_immediately() -> None:
    plan = ChunkPlan(100, 16, 4, 4)
    first = plan.steps[0]
    assert first.name == "N0" and first.emission is not None and first.emission.frames == range(0, 16)


def test_audio_shorter_than_one_chunk() -> None:
    plan = ChunkPlan(5, 16, 4, 4)
    assert names(plan) == ["N0"]
    assert plan.steps[0].emission is not None and plan.steps[0].emission.frames == range(0, 5)


def test_exactly_one_chunk() -> None:
    plan = ChunkPlan(16, 16, 4, 4)
    assert names(plan) == ["N0"]


def test_short_last_chunk_shrinks_the_interpolation_span() -> None:
    plan = ChunkPlan(16 + 3, 16, 4, 4)  # last N chunk has 3 frames: e shrinks to 2
    steps = {s.name: s for s in plan.steps}
    assert names(plan) == ["N0", "N1", "I0"]
    assert steps["I0"].generate == range(16, 18)
    assert steps["I0"].known == (15, 18)
    assert steps["I0"].emission is not None and steps["I0"].emission.frames == range(16, 19)


def test_one_frame_last_chunk_gets_no_i_chunk() -> None:
    plan = ChunkPlan(17, 16, 4, 4)
    assert names(plan) == ["N0", "N1"]
    n1 = plan.steps[1]
    assert n1.emission is not None and n1.emission.frames == range(16, 17)
    assert n1.known == (12, 13, 14, 15)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        (dict(num_frames=0, chunk_frames=16, context_frames=4, interp_frames=4), "num_frames"),
        (dict(num_frames=10, chunk_frames=1, context_frames=0, interp_frames=1), "chunk_frames"),
        (dict(num_frames=10, chunk_frames=16, context_frames=17, interp_frames=4), "context_frames"),
        (dict(num_frames=10, chunk_frames=16, context_frames=-1, interp_frames=4), "context_frames"),
        (dict(num_frames=10, chunk_frames=16, context_frames=4, interp_frames=0), "interp_frames"),
        (dict(num_frames=10, chunk_frames=16, context_frames=4, interp_frames=16), "interp_frames"),
    ],
)
def test_invalid_parameters_are_rejected_by_name(kwargs: dict[str, int], field: str) -> None:
    with pytest.raises(PlanError, match=field):
        ChunkPlan(**kwargs)


def test_frames_for_audio_rounds_up_and_rejects_empty_audio() -> None:
    assert frames_for_audio(16000, 16000, 25) == 25
    assert frames_for_audio(16001, 16000, 25) == 26
    assert frames_for_audio(1, 16000, 25) == 1
    with pytest.raises(PlanError, match="no samples"):
        frames_for_audio(0, 16000, 25)


def test_reference_frame_anchors_every_n_chunk() -> None:
    plan = ChunkPlan(40, 16, 4, 4, reference_frame=True)
    steps = {s.name: s for s in plan.steps}
    n0 = steps["N0"]
    assert n0.window == range(-1, 16) and n0.known == (-1,) and n0.generate == range(0, 16)
    assert n0.known_mask() == [True] + [False] * 16
    n1 = steps["N1"]  # the reference slot in front of the context
    assert n1.window == range(11, 32) and n1.known == (11, 12, 13, 14, 15) and n1.generate == range(16, 32)
    assert n1.known_mask() == [True] * 5 + [False] * 16
    assert all(s.reference_slot == (s.kind is ChunkKind.N) for s in plan.steps)
    assert steps["I0"] == next(s for s in ChunkPlan(40, 16, 4, 4).steps if s.name == "I0")  # I unchanged
    assert not any(s.reference_slot for s in ChunkPlan(40, 16, 4, 4).steps)
    assert plan.key != ChunkPlan(40, 16, 4, 4).key  # a resume state never crosses the two
    assert [s.emission.frames for s in plan.steps if s.emission] == [
        s.emission.frames for s in ChunkPlan(40, 16, 4, 4).steps if s.emission]


def test_every_i_step_shares_its_forward_with_the_next_n_step_whose_inputs_it_does_not_write() -> None:
    from pipeline.pipeline import _groups
    from pipeline.schedule import can_share_forward

    plan = ChunkPlan(num_frames=65, chunk_frames=16, context_frames=4, interp_frames=4)
    steps = plan.steps
    groups = [[r.step.name for r in g] for g in _groups(plan.released(), batching=True)]
    assert groups == [["N0"], ["N1"], ["I0", "N2"], ["I1", "N3"], ["I2", "N4"]]
    # what makes a pair safe: the N step's known frames come from N chunks before the I step only
    for first, second in zip(steps, steps[1:], strict=False):
        if can_share_forward(first, second):
            assert first.kind is ChunkKind.I and second.kind is ChunkKind.N
            assert set(second.known) <= set(plan.n_range(second.index - 1))  # N_{k+1} sees N_k only
            assert set(second.known).isdisjoint(first.generate)
    assert not can_share_forward(steps[1], steps[2])  # N1 then I0: I0's anchor is N1's frame e
    assert [[r.step.name for r in g] for g in _groups(plan.released(), batching=False)] == [[s.name] for s in steps]
    no_i = ChunkPlan(num_frames=65, chunk_frames=16, context_frames=4, interp_frames=4, use_i_chunks=False)
    assert all(len(g) == 1 for g in _groups(no_i.released(), batching=True))


def test_groups_take_the_next_step_only_to_pair_it() -> None:
    # a live schedule's next step blocks until its audio has come: without batching, the current
    # step must run before the next one is asked for
    from pipeline.pipeline import _groups

    plan = ChunkPlan(num_frames=40, chunk_frames=16, context_frames=4, interp_frames=4)
    taken: list[str] = []

    def released():  # type: ignore[no-untyped-def]
        for r in plan.released():
            taken.append(r.step.name)
            yield r

    for batching in (False, True):
        taken.clear()
        seen = []
        for group in _groups(released(), batching=batching):
            seen.append((group[-1].step.name, list(taken)))
        if not batching:  # each group was handed out when it was the last step taken
            assert all(taken_then[-1] == name for name, taken_then in seen), seen
        else:  # N0 is handed out with N1 already taken (to see whether they pair); I0 + N2 together
            assert [name for name, _ in seen] == ["N0", "N1", "N2", "I1"] and seen[0][1] == ["N0", "N1"]
