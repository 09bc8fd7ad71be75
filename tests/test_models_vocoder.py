"""The stateful streaming Code2Wav decoder: chunk by chunk, streams batched at any point,
it is the whole-utterance decode; its state lives in slots freed with the request."""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest
import torch

from omnirelay.errors import ModelError
from omnirelay.models.qwen3_omni import Checkpoint
from omnirelay.models.runner.vocoder import StreamingVocoder, StreamRow
from tests.test_models_support import single_thread, tiny_dir

Q = 16
U = 1920
TOL = 1e-5


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    yield from single_thread()


@pytest.fixture(scope="module", params=["tiny", "wide-window"])
def model(request: pytest.FixtureRequest) -> object:
    """The tiny decoder (a 2-frame attention window, one layer) and one built from its
    config with a 9-frame window and two layers, so chunks cross the window's edge."""
    tiny = Checkpoint.open(tiny_dir()).load_code2wav()
    if request.param == "tiny":
        return tiny
    values = {k: v for k, v in tiny.config.to_dict().items() if k != "layer_types"}
    config = tiny.config.__class__.from_dict({**values, "sliding_window": 9, "num_hidden_layers": 2})
    torch.manual_seed(0)
    wide = type(tiny)._from_config(config)
    for p in wide.parameters():  # the real checkpoint's layer scales are not 0.01-small
        if p.dim() == 1 and p.numel() == config.hidden_size:
            p.data.normal_(0, 0.3)
    return wide.eval()


def whole(model: object, codes: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = model(codes.unsqueeze(0))[0, 0]  # type: ignore[operator]
    return out


def test_the_holdback_is_the_lookahead_of_the_up_sampling_layers(model: object) -> None:
    voc = StreamingVocoder(model, max_streams=2, cuda_graphs=False)
    codes = torch.randint(0, 2048, (Q, 8), generator=torch.Generator().manual_seed(0))
    assert whole(model, codes).shape[0] == 8 * U - voc.holdback
    assert voc.holdback == 38  # 2 + 2 * 3 + 2 * 3 * 5: one sample of look-ahead per layer


@pytest.mark.parametrize("seed", [0, 1])
def test_streams_chunked_and_batched_at_any_point_decode_the_whole_utterance(
    model: object, seed: int
) -> None:
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    lengths = {"a": 60, "b": 37, "c": 45, "d": 1}
    codes = {rid: torch.randint(0, 2048, (Q, n), generator=gen) for rid, n in lengths.items()}
    voc = StreamingVocoder(model, max_streams=4, cuda_graphs=False)
    sent = dict.fromkeys(lengths, 0)
    pieces: dict[str, list[torch.Tensor]] = {rid: [] for rid in lengths}
    step = 0
    with torch.inference_mode():
        while any(sent[r] < n for r, n in lengths.items()):
            rows = []
            for rid, n in lengths.items():
                if sent[rid] >= n or (rid in "cd" and step < 3) or rng.random() < 0.2:
                    continue  # done, not started yet, or no chunk ready this step
                k = min(rng.choice([1, 2, 3, 5, 8, 13, 25]), n - sent[rid])
                rows.append(StreamRow(rid, codes[rid][:, sent[rid] : sent[rid] + k]))
                sent[rid] += k
            for row, piece in zip(rows, voc.decode(rows)):
                pieces[row.rid].append(piece)
            step += 1
    assert len(voc.slots) == 4
    for rid in lengths:
        got, want = torch.cat(pieces[rid]), whole(model, codes[rid])
        assert got.shape == want.shape, rid
        assert float((got - want).abs().max()) < TOL, rid
        voc.release(rid)
    assert len(voc.slots) == 0 and voc.slots.num_free == 4


def test_a_released_slot_starts_the_next_stream_from_silence(model: object) -> None:
    voc = StreamingVocoder(model, max_streams=1, cuda_graphs=False)
    gen = torch.Generator().manual_seed(3)
    first, second = (torch.randint(0, 2048, (Q, 12), generator=gen) for _ in range(2))
    with torch.inference_mode():
        voc.decode([StreamRow("x", first)])
        voc.release("x")
        (got,) = voc.decode([StreamRow("y", second)])  # the same slot, a new stream
    assert float((got - whole(model, second)).abs().max()) < TOL


def test_a_stream_keeps_its_state_when_one_in_a_lower_slot_leaves(model: object) -> None:
    """The slot table keeps its holders packed: when ``x`` (slot 0) leaves, ``y`` moves
    from slot 1 into slot 0, and its state must move with it."""
    voc = StreamingVocoder(model, max_streams=2, cuda_graphs=False)
    gen = torch.Generator().manual_seed(5)
    x, y, z = (torch.randint(0, 2048, (Q, 6), generator=gen) for _ in range(3))
    with torch.inference_mode():
        _, first = voc.decode([StreamRow("x", x[:, :3]), StreamRow("y", y[:, :3])])
        _, second = voc.decode([StreamRow("x", x[:, 3:]), StreamRow("y", y[:, 3:4])])
        assert voc.slots.slot("y") == 1
        voc.release("x")
        assert voc.slots.slot("y") == 0  # moved down into the freed slot
        _, rest = voc.decode([StreamRow("z", z[:, :2]), StreamRow("y", y[:, 4:])])
    got = torch.cat([first, second, rest])
    assert float((got - whole(model, y)).abs().max()) < TOL


def test_a_step_refuses_a_stream_twice_and_a_stream_too_many() -> None:
    model = Checkpoint.open(tiny_dir()).load_code2wav()
    voc = StreamingVocoder(model, max_streams=1, cuda_graphs=False)
    codes = torch.zeros((Q, 2), dtype=torch.long)
    with pytest.raises(ModelError, match="one stream twice"):
        voc.decode([StreamRow("x", codes), StreamRow("x", codes)])
    with torch.inference_mode():
        voc.decode([StreamRow("x", codes)])
        with pytest.raises(ModelError, match="slots are taken"):
            voc.decode([StreamRow("y", codes)])
