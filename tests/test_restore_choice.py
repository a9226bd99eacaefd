"""One source and one step for every rank (``nbtrain.core.restore_choice``): the cases that
used to diverge or hang (a rank that finds no source, an agreement that fell to step 0, ranks
reading different sources) and the resume source that vanished while its job waited."""

from __future__ import annotations

import pytest

from nbtrain.core.restore_choice import RankView, RestoreChoice, RestoreError, choose_restore

OWN = ("/ck/job-1", None)
RESUME = ("/ck/old-job", None)


def views(*per_rank: tuple[tuple[int, ...], ...]) -> list[RankView]:
    return [RankView(rank, f"host{rank}", steps) for rank, steps in enumerate(per_rank)]


def test_every_rank_restores_the_newest_step_all_of_them_see() -> None:
    seen = views(((30, 20, 10),), ((20, 10),))  # rank 1 does not see step 30 yet
    assert choose_restore([OWN], seen) == RestoreChoice(0, (20, 10))


def test_a_rank_that_sees_no_checkpoint_is_an_error_naming_what_each_saw() -> None:
    """It used to return before the agreement the others entered (their collectives then
    mismatched), or to start fresh beside ranks that had loaded a checkpoint."""
    with pytest.raises(RestoreError) as err:
        choose_restore([OWN, RESUME], views(((20, 10), (5,)), ((), (5,))))
    text = str(err.value)
    assert "rank 0 on host0: steps 20, 10" in text and "rank 1 on host1: none" in text
    assert "shared filesystem" in text  # not a silent fall-back to the resume source


def test_ranks_without_a_common_step_do_not_restore_different_ones() -> None:
    with pytest.raises(RestoreError, match="do not see the same checkpoints"):
        choose_restore([OWN], views(((30,),), ((20,),)))


def test_the_own_directory_comes_first_then_the_resume_source() -> None:
    assert choose_restore([OWN, RESUME], views(((), (8, 4)), ((), (8, 4)))) == \
        RestoreChoice(1, (8, 4))
    assert choose_restore([OWN, RESUME], views(((2,), (8,)), ((2,), (8,)))) == \
        RestoreChoice(0, (2,))


def test_a_fresh_job_starts_fresh_and_a_vanished_resume_source_is_an_error() -> None:
    assert choose_restore([OWN], views(((),), ((),))) is None
    with pytest.raises(RestoreError, match=r"resume source /ck/old-job held a committed "
                                           r"checkpoint when the job was submitted but holds "
                                           r"none now"):
        choose_restore([OWN, RESUME], views(((), ()), ((), ())))


def test_a_pinned_step_that_is_gone_is_an_error_not_an_older_step() -> None:
    pinned = ("/ck/old-job", 40)
    with pytest.raises(RestoreError, match="pinned resume step 40"):
        choose_restore([OWN, pinned], views(((), (30, 20)), ((), (30, 20))))
    assert choose_restore([OWN, pinned], views(((), (40, 30)), ((), (40, 30)))) == \
        RestoreChoice(1, (40, 30))


def test_storage_every_rank_sees_is_fine_and_anything_else_names_who_saw_what() -> None:
    from nbtrain.core.restore_choice import ProbeReport, storage_problem

    assert storage_problem("/shared", [ProbeReport(0, "a", "", ()),
                                       ProbeReport(1, "b", "", ())]) == ""
    text = storage_problem("/local", [ProbeReport(0, "a", "", (1,)),
                                      ProbeReport(1, "b", "", (0,)),
                                      ProbeReport(2, "c", "PermissionError: denied", ())])
    assert "do not share the checkpoint storage /local" in text
    assert "rank 0 on a does not see the files of ranks 1" in text
    assert "rank 2 on c could not write there (PermissionError: denied)" in text
    assert "object store URL" in text
