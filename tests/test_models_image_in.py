"""Image input on the Qwen3-Omni Thinker (dynamic runner) against ``transformers``' own
Thinker forward: the same 3-D positions and rope delta, the vision tower's rows at the
image positions, the deepstack features in the first layers, and decode steps that
continue from the rope delta; the layout arithmetic against the library's processor."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

from omnirelay.errors import ModelError
from omnirelay.models.family import ImageSlot
from omnirelay.models.inputs import image_inputs, read_image_inputs
from omnirelay.models.qwen3_omni import Checkpoint
from omnirelay.models.qwen3_omni.loader import ModelArgs
from omnirelay.models.qwen3_omni.prompt import QwenPromptSide
from omnirelay.models.qwen3_omni.thinker import ThinkerExecutor
from omnirelay.models.qwen3_omni.vision import QwenImageEncoder, VisionLayout, mrope_positions
from tests.test_models_support import item, single_thread, tiny_dir

DECODE_STEPS = 3


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    torch.set_flush_denormal(True)
    yield from single_thread()


@pytest.fixture(scope="module")
def thinker() -> ThinkerExecutor:
    return ThinkerExecutor.from_checkpoint(Checkpoint.open(tiny_dir()), ModelArgs(runner="dynamic"))


def _image(seed: int, height: int, width: int, layout: VisionLayout) -> torch.Tensor:
    h, w = layout.fit(height, width)
    pixels = np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8)
    return image_inputs([pixels])[0]


def _prompt(thinker: ThinkerExecutor, images: list[torch.Tensor]) -> list[int]:
    layout = thinker.vision
    assert layout is not None
    prompts = QwenPromptSide(thinker.tokenizer, vision=layout)
    parts: list[str | ImageSlot] = ["Look: "]
    for img in images:
        parts += [ImageSlot(img.shape[0], img.shape[1]), " and "]
    return prompts.encode_chat_media([("system", ["Be brief."]), ("user", [*parts, "say what you see."])])


def _reference(thinker: ThinkerExecutor, ids: list[int], images: list[torch.Tensor]) -> object:
    """``transformers``' Thinker forward over ``ids`` (positions from its get_rope_index)."""
    assert thinker.vision is not None
    pixel_values, grid = QwenImageEncoder(thinker.model.model.visual, thinker.vision).pixels(images)
    thinker.model.model.rope_deltas = None
    with torch.inference_mode():
        return thinker.model(
            input_ids=torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            pixel_values=pixel_values,
            image_grid_thw=grid,
            output_hidden_states=True,
            use_cache=False,
        )


def test_positions_are_transformers_rope_index(thinker: ThinkerExecutor) -> None:
    layout = thinker.vision
    assert layout is not None and layout.max_pixels == 64 * 64  # the tiny processor file
    images = [_image(1, 24, 40, layout), _image(2, 70, 20, layout)]
    ids = _prompt(thinker, images)
    grids = [layout.grid(img.shape[0], img.shape[1]) for img in images]
    ours, delta = mrope_positions(ids, int(thinker.image_token_id or 0), grids, layout.merge_size)
    theirs, deltas = thinker.model.model.get_rope_index(
        torch.tensor([ids]), torch.tensor(grids), None, torch.ones(1, len(ids), dtype=torch.long)
    )
    assert torch.equal(ours, theirs[:, 0].long()) and delta == int(deltas) and delta < 0


def test_prefill_and_decode_equal_the_reference_forward(thinker: ThinkerExecutor) -> None:
    layout = thinker.vision
    assert layout is not None
    images = [_image(3, 40, 56, layout)]
    ids = _prompt(thinker, images)
    pads = [j for j, t in enumerate(ids) if t == thinker.image_token_id]
    assert len(pads) == layout.num_tokens(40, 56) == 35
    inputs = {"images": images}
    rid = "img@s0.0"
    try:
        out = thinker.step([item(rid, input_ids=ids, inputs=inputs)])[0]
        hidden = out.next_stage_output["hidden_layers"]
        ref = _reference(thinker, ids, images)
        # The rows at the image positions are exactly the vision tower's output.
        with torch.inference_mode():
            pixel_values, grid = QwenImageEncoder(thinker.model.model.visual, layout).pixels(images)
            tower = thinker.model.model.get_image_features(pixel_values, grid, return_dict=True)
        assert torch.equal(hidden[0][pads], torch.cat(tower.pooler_output))
        layer = thinker.accept_hidden_layer
        torch.testing.assert_close(hidden[layer], ref.hidden_states[layer][0], rtol=1e-5, atol=1e-6)
        assert out.token_ids == [int(ref.logits[0, -1].argmax())]
        seq = list(ids) + out.token_ids
        for _ in range(DECODE_STEPS):
            step = thinker.step([item(rid, input_ids=seq[-1:], all_ids=seq, computed=len(seq) - 1)])[0]
            ref = _reference(thinker, seq, images)
            # A wrong rope delta moves every later query and key: the hidden state differs.
            got = step.next_stage_output["hidden_layers"][layer]
            torch.testing.assert_close(got[0], ref.hidden_states[layer][0, -1], rtol=1e-5, atol=1e-6)
            assert step.token_ids == [int(ref.logits[0, -1].argmax())]
            seq += step.token_ids
    finally:
        thinker.release(rid)
    assert thinker.num_live_requests() == 0


def test_a_prefill_cut_inside_the_image_equals_the_whole_one(thinker: ThinkerExecutor) -> None:
    """A chunked prefill whose cut falls among the image tokens: each piece gets its own
    rows, deepstack features and 3-D positions, and the result is the one-piece prefill's."""
    layout = thinker.vision
    assert layout is not None
    images = [_image(12, 40, 40, layout)]
    ids = _prompt(thinker, images)
    cut = [j for j, t in enumerate(ids) if t == thinker.image_token_id][10]
    inputs = {"images": images}
    try:
        whole = thinker.step([item("w@s0.0", input_ids=ids, inputs=inputs)])[0]
        first = thinker.step([item("c@s0.0", input_ids=ids[:cut], all_ids=ids, inputs=inputs)])[0]
        rest = thinker.step([item("c@s0.0", input_ids=ids[cut:], all_ids=ids, computed=cut, inputs=inputs)])[
            0
        ]
    finally:
        thinker.release("w@s0.0")
        thinker.release("c@s0.0")
    assert first.is_partial_prefill and first.token_ids == [] and first.next_stage_output is None
    assert rest.token_ids == whole.token_ids
    for layer, rows in whole.next_stage_output["hidden_layers"].items():
        # The last piece hands on the rows of the whole prompt, the earlier pieces' first.
        torch.testing.assert_close(rest.next_stage_output["hidden_layers"][layer], rows, rtol=1e-5, atol=1e-6)


def test_different_images_give_different_tokens(thinker: ThinkerExecutor) -> None:
    layout = thinker.vision
    assert layout is not None
    answers = []
    for seed in (4, 5):
        images = [_image(seed, 32, 32, layout)]
        ids = _prompt(thinker, images)
        rid = f"diff{seed}@s0.0"
        seq = list(ids)
        try:
            for k in range(6):
                computed = 0 if k == 0 else len(seq) - 1
                piece = seq if k == 0 else seq[-1:]
                res = thinker.step(
                    [item(rid, input_ids=piece, all_ids=seq, computed=computed, inputs={"images": images})]
                )
                seq += res[0].token_ids
        finally:
            thinker.release(rid)
        answers.append(seq[len(ids) :])
    assert answers[0] != answers[1]


def test_layout_fit_is_the_processors_resize(thinker: ThinkerExecutor) -> None:
    layout = thinker.vision
    assert layout is not None
    encoder = QwenImageEncoder(thinker.model.model.visual, layout)
    for height, width in [(1, 1), (7, 300), (33, 33), (64, 64), (500, 400), (9, 1000)]:
        pixels = np.zeros((height, width, 3), dtype=np.uint8)
        _, grid = encoder.pixels([torch.from_numpy(pixels)])
        h, w = layout.fit(height, width)
        assert tuple(grid[0].tolist()) == layout.grid(h, w)
        # within the range, except a side already at its smallest (a very narrow image)
        assert layout.min_pixels <= h * w and (h * w <= layout.max_pixels or min(h, w) == layout.factor)
    with pytest.raises(ValueError, match="aspect ratio"):
        layout.fit(1, 500)


def test_the_real_layout_and_the_input_contract() -> None:
    from omnirelay.models.qwen3_omni.dummy import FULL_SIZE_CONFIG
    from omnirelay.models.qwen3_omni.vision import layout_of_checkpoint

    config = Checkpoint.open(FULL_SIZE_CONFIG, load_format="dummy").config
    real = layout_of_checkpoint(config, None)
    assert real is not None and (real.patch_size, real.merge_size, real.temporal_patch_size) == (16, 2, 2)
    assert real.num_tokens(*real.fit(448, 448)) == 196  # one token per 32 x 32 pixels
    assert read_image_inputs({"audio": []}, "r") == []
    with pytest.raises(ModelError, match="image 0 must be an RGB uint8"):
        read_image_inputs({"images": [torch.zeros(4, 4, 3)]}, "r")
    with pytest.raises(ModelError, match="must be a list of images"):
        read_image_inputs({"images": torch.zeros(4, 4, 3, dtype=torch.uint8)}, "r")


def test_bad_image_requests_fail_cleanly(thinker: ThinkerExecutor) -> None:
    layout = thinker.vision
    assert layout is not None
    images = [_image(6, 32, 32, layout)]
    ids = _prompt(thinker, images)
    with pytest.raises(ModelError, match="image positions but no image input"):
        thinker.step([item("noimg@s0.0", input_ids=ids)])
    with pytest.raises(ModelError, match="image positions but its 2 image"):
        thinker.step([item("two@s0.0", input_ids=ids, inputs={"images": images * 2})])
    assert thinker.num_live_requests() == 0


def test_the_static_runner_refuses_images_up_front_and_in_the_thinker() -> None:
    from omnirelay.models.qwen3_omni.prompt import thinker_vision

    args = {"model_dir": str(tiny_dir())}
    layout, refusal = thinker_vision({**args, "runner": "static"})
    assert layout is None and refusal is not None and "static (CUDA graph) runner" in refusal
    assert thinker_vision({**args, "runner": "dynamic"}) == (thinker_vision(args)[0], None)
    static = ThinkerExecutor.from_checkpoint(
        Checkpoint.open(tiny_dir()),
        ModelArgs(runner="static", cuda_graphs=False, max_num_seqs=2, max_model_len=256),
    )
    assert static.vision is not None
    images = [_image(11, 16, 16, static.vision)]
    with pytest.raises(ModelError, match="the static runner takes no image input"):
        static.step([item("s@s0.0", input_ids=_prompt(static, images), inputs={"images": images})])
    assert static.num_live_requests() == 0
