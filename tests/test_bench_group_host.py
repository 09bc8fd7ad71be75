"""The host-work bench of a device group (benchmarks/group_host.py): the qwen3-tts Talker
and Code2Wav engines in one group loop with executors that cost nothing on the device
deliver every request's audio, each frame once, and the bench reports its figures."""

from __future__ import annotations

from benchmarks.group_host import SAMPLES_PER_FRAME, HostRun, measure


def test_every_request_gets_all_its_frames_as_audio_once() -> None:
    run = HostRun(4, seed=3, device_time=False)
    try:
        run.run_until(lambda: run.num_done >= 4)  # 20–90 frames each: the first four end
        for rid in run.done:
            assert run.samples[rid] == run.lengths[rid] * SAMPLES_PER_FRAME, rid
        assert run.talker.num_rows == 4 * run.talker.num_steps  # four rows every step
    finally:
        run.close()


def test_the_bench_reports_the_host_work_per_row() -> None:
    result = measure(4, steps=20, warmup=5, parts=True)
    assert 0 < result["talker_rows_per_step"] <= 4  # a step may launch before a new request came
    assert result["loop_thread_us_per_row_step"] > 0 and result["process_us_per_row_step"] > 0
    assert "complete: results, outputs, chunks" in result["parts_us_per_row_step"]
