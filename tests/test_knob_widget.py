"""The notebook widget's knob inputs without a browser: a real 2-rank job on the shared
cluster, the widgets on a recording comm, the Apply button pressed with the browser's
message; what the widget sent to the browser, what the job applied, and the refusals shown."""

from __future__ import annotations

import re
from typing import Any

import ipywidgets as widgets

import nbtrain
from nbtrain import JobState
from nbtrain.ui.dashboard import JobDashboard
from tests import recipes
from tests.conftest import wait_for
from tests.test_dashboard import RecordingComm, click, comms  # noqa: F401  (the fixture)


def _states(made: list[RecordingComm]) -> list[dict[str, Any]]:
    """Every widget state the kernel sent to the browser."""
    out = []
    for c in made:
        for m in c.sent:
            state = (m["data"] or {}).get("state")
            if isinstance(state, dict):
                out.append(state)
    return out


def test_apply_sends_the_changed_knobs_and_shows_the_step_or_the_refusal(
        free_cluster: nbtrain.Cluster, comms: list[RecordingComm]) -> None:  # noqa: F811
    job = free_cluster.submit(recipes.steered_train, world_size=2, steps=1_000_000,
                              config={"step_sleep": 0.01}, checkpoint=50, name="knob-widget")
    dash = JobDashboard(job, start=False)
    knobs = dash.knob_inputs
    assert knobs is not None and knobs in dash.children
    try:
        wait_for(lambda: dash.refresh() and "aux_weight" in knobs.fields, 120,
                 "the knob inputs")
        fields, sliders = knobs.fields, knobs.sliders
        assert set(fields) >= {"lr", "lr_factor", "weight_decay", "grad_clip", "aux_weight",
                               "checkpoint_every", "straggler_ratio", "straggler_window"}
        # A slider where both bounds exist; whole numbers for whole-number knobs.
        assert set(sliders) >= {"lr", "aux_weight", "straggler_confirm_share",
                                "straggler_window"}
        assert "lr_factor" not in sliders and "checkpoint_every" not in sliders
        assert isinstance(fields["checkpoint_every"], widgets.IntText)
        assert isinstance(sliders["straggler_window"], widgets.IntSlider)
        assert fields["checkpoint_every"].value == 50 and fields["aux_weight"].value == 0.1
        # The browser got the inputs (their state went out on the comm).
        described = {s.get("description") for s in _states(comms)}
        assert {"aux_weight", "checkpoint_every", "straggler_ratio"} <= described

        click(knobs.apply)
        assert "no knob changed" in knobs.status.value

        sliders["aux_weight"].value = 0.5  # the slider moves the input with it
        assert fields["aux_weight"].value == 0.5
        fields["lr"].value = 0.02  # and the input the slider
        assert sliders["lr"].value == 0.02
        fields["checkpoint_every"].value = 25
        click(knobs.apply)
        assert "pending" in knobs.status.value
        wait_for(lambda: dash.refresh() and "applied at step" in knobs.status.value, 60,
                 "the change applied")
        [change] = job.knobs.history
        assert dict(change.values) == {"aux_weight": 0.5, "lr": 0.02, "checkpoint_every": 25}
        shown = re.search(r"applied at step (\d+)", knobs.status.value)
        assert shown and int(shown.group(1)) == change.step
        assert knobs.changed() == {}  # the inputs are the values in force now

        # Refusals: the handle's own check (a bound), the controller's (settings that do not
        # go together), each shown in red with its reason; nothing is pending.
        fields["aux_weight"].value = 2.0
        click(knobs.apply)
        assert "#c33" in knobs.status.value
        assert "aux_weight=2: 2 is above its max 1" in knobs.status.value
        fields["aux_weight"].value = 0.5
        fields["straggler_window"].value = 2
        click(knobs.apply)
        assert "#c33" in knobs.status.value and "do not go together" in knobs.status.value
        assert "suspect_votes must be between 1 and window=2" in knobs.status.value
        assert job.knobs.pending == () and len(job.knobs.history) == 1

        job.stop()
        wait_for(lambda: (dash.refresh() or True) and job.done, 60, "the job to stop")
        dash.refresh()
        assert knobs.apply.disabled and "can no longer change" in knobs.status.value
    finally:
        job.stop()
        assert job.wait(60) in (JobState.CANCELLED, JobState.SUCCEEDED)
