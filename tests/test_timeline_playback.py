"""What a listener hears: first playable audio, gaps and silence of a stream (pure)."""

from __future__ import annotations

import pytest

from omnirelay.timeline.playback import GAP_FREE_MAX_S, playback_of


def test_a_stream_that_keeps_ahead_is_playable_from_its_first_audio() -> None:
    pb = playback_of([(0.10, 0.08), (0.15, 0.08), (0.20, 0.5), (0.60, 1.0)])
    assert pb.first_audio_s == pytest.approx(0.10) and pb.first_playable_s == pytest.approx(0.10)
    assert (pb.num_underruns, pb.worst_gap_s, pb.silence_s, pb.worst_gap_at) == (0, 0.0, 0.0, None)
    assert pb.is_gap_free and pb.num_chunks == 4 and pb.audio_s == pytest.approx(1.66)


def test_gaps_shift_the_player_and_first_playable_is_the_start_that_never_waits() -> None:
    # 50 ms of audio, then a chunk 100 ms later: the player waits 50 ms, then resumes.
    pb = playback_of([(0.10, 0.05), (0.20, 0.10), (0.50, 0.10), (0.90, 0.20)])
    assert pb.gaps_s == pytest.approx((0.05, 0.20, 0.30))
    assert pb.num_underruns == 3 and pb.silence_s == pytest.approx(0.55)
    assert pb.worst_gap_s == pytest.approx(0.30) and pb.worst_gap_at == 3
    # starting at 0.65 s: 0.65 + 0.05 + 0.10 + 0.10 = 0.90, the last chunk's arrival
    assert pb.first_playable_s == pytest.approx(0.65)
    assert not pb.is_gap_free


def test_gap_free_allows_gaps_up_to_fifty_ms() -> None:
    assert playback_of([(0.0, 0.1), (0.1 + GAP_FREE_MAX_S - 0.001, 0.1)]).is_gap_free
    assert not playback_of([(0.0, 0.1), (0.1 + GAP_FREE_MAX_S + 0.001, 0.1)]).is_gap_free


def test_chunks_without_audio_are_skipped_and_no_audio_means_no_first_audio() -> None:
    pb = playback_of([(0.05, 0.0), (0.10, 0.1), (0.30, 0.0)])
    assert pb.num_chunks == 1 and pb.first_audio_s == pytest.approx(0.10)
    empty = playback_of([])
    assert empty.first_audio_s is None and empty.first_playable_s is None and empty.is_gap_free
    assert empty.to_dict()["num_chunks"] == 0
    with pytest.raises(ValueError, match=">= 0"):
        playback_of([(-1.0, 0.1)])
