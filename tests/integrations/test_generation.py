"""transformers' ``generate()`` as one region of its model (Note [Generation as one region]
in torchTensorRef/integrations/generation.py): with nothing to page, the whole loop runs on
plain tensors; wherever user code or a budget needs the per-call path, it is kept. Every
result is plain torch's on the same device."""

from __future__ import annotations

import gc

import pytest
import torch

import torchTensorRef
from torchTensorRef import TensorRef, regions, tensorsManager as tm
from torchTensorRef.integrations.generation import _settings_only
from paired import assert_identical, budget, plain_torch

transformers = pytest.importorskip("transformers")

CONFIG = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64)
#: (prompt length, new tokens) of each call: no two alike
REQUESTS = [(5, 6), (9, 3), (3, 8)]
GENERATE = "generate LlamaForCausalLM"


pytestmark = pytest.mark.usefixtures("regions_on")


@pytest.fixture(params=["device", "pass-through"])
def device(request):
    """The test device, and "cpu" (pass-through: nothing ever moves)."""
    if request.param == "pass-through":
        gc.collect()  # (an earlier test's model, in cycles, may still hold blocks of the test device)
        tm.device = "cpu"
    yield tm.device
    gc.collect()  # (this one's, before the device is set back)


def llama():
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**CONFIG)).eval()


def prompts():
    return torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(3))


def request(ids, prompt: int):
    """A prompt (a prefix of ``ids``) and its attention mask."""
    return ids[:, :prompt], torch.ones_like(ids[:, :prompt])


def generate(model, prompt, tokens: int, **kwargs):
    ids, mask = prompt
    return model.generate(ids, attention_mask=mask, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False,
                          pad_token_id=0, **kwargs)


def plain_results(requests, **kwargs):
    with plain_torch():
        model, ids = llama().to(tm.torch_device), prompts().to(tm.torch_device)
        out = [generate(model, request(ids, p), n, **kwargs) for p, n in requests]
        del model
    gc.collect()  # (the plain model's device bytes would count as outside the manager)
    return out


class OpNames:
    """The names of the ops the manager runs (regions included), while in a ``with``."""

    def __enter__(self):
        self.names = []
        self.handle = tm.add_callback(before=lambda op: self.names.append(op.name))
        return self

    def __exit__(self, *exc):
        self.handle.remove()

    def count(self, name: str) -> int:
        return sum(n == name for n in self.names)


def test_generate_with_nothing_to_page_is_one_region_and_matches_plain_torch(device):
    expected = plain_results(REQUESTS)
    model, ids = llama(), torchTensorRef.manage(prompts())
    for (prompt, tokens), plain_tokens in zip(REQUESTS, expected):
        given = request(ids, prompt)
        with OpNames() as ops:
            got = generate(model, given, tokens)
        assert isinstance(got, TensorRef) and got.device == ids.device
        assert_identical(plain_tokens, got)
        # the whole loop is one op: not a layer's region, not one op of generate's own
        assert ops.names == [GENERATE], ops.names[:8]
    for p in model.parameters():  # (the parameters are the model's TensorRefs again)
        assert isinstance(p, TensorRef) and isinstance(p, torch.nn.Parameter)


def test_generate_s_output_object_comes_back_as_tensor_refs(device):
    options = dict(return_dict_in_generate=True, output_scores=True)
    expected = plain_results(REQUESTS[:1], **options)[0]
    model, ids = llama(), torchTensorRef.manage(prompts())
    given = request(ids, REQUESTS[0][0])
    with OpNames() as ops:
        got = generate(model, given, REQUESTS[0][1], **options)
    assert ops.names == [GENERATE]
    assert isinstance(got.sequences, TensorRef) and all(isinstance(s, TensorRef) for s in got.scores)
    assert_identical(expected.sequences, got.sequences)
    assert len(got.scores) == len(expected.scores)
    for plain_scores, scores in zip(expected.scores, got.scores):
        assert_identical(plain_scores, scores, "scores")


class Recording(transformers.LogitsProcessor):
    """A user's logits processor: records what it is given, changes nothing."""

    def __init__(self):
        self.given = []

    def __call__(self, input_ids, scores):
        self.given += [type(input_ids), type(scores)]
        return scores


def test_generate_handing_tensors_to_user_code_keeps_them_tensor_refs(device):
    expected = plain_results(REQUESTS[:1])[0]
    model, ids = llama(), torchTensorRef.manage(prompts())
    processor = Recording()
    given = request(ids, REQUESTS[0][0])
    with OpNames() as ops:
        got = generate(model, given, REQUESTS[0][1], logits_processor=transformers.LogitsProcessorList([processor]))
    assert_identical(expected, got)
    assert processor.given and set(processor.given) == {TensorRef}
    # the model's calls are still regions (on a device, the first measured op by op)
    assert ops.count(GENERATE) == 0 and ops.count("region LlamaForCausalLM") >= REQUESTS[0][1] - 2


def test_a_hooked_model_s_generate_is_not_one_region(device):
    expected = plain_results(REQUESTS[:1])[0]
    model, ids = llama(), torchTensorRef.manage(prompts())
    seen = []
    handle = model.model.layers[1].register_forward_pre_hook(lambda m, args: seen.append(type(args[0])))
    try:
        with OpNames() as ops:
            got = generate(model, request(ids, REQUESTS[0][0]), REQUESTS[0][1])
    finally:
        handle.remove()
    assert_identical(expected, got)
    assert ops.count(GENERATE) == 0 and seen and set(seen) == {TensorRef}


def test_generate_under_a_budget_pages_its_model_calls():
    expected = plain_results(REQUESTS)
    model, ids = llama(), torchTensorRef.manage(prompts())
    tm.strategy = "flow"
    tm.budget = budget(sum(t.numel() * t.element_size() for t in model.state_dict().values()) // 2)
    tm.reset_stats()  # (the model was made resident before the budget)
    loops = []
    for (prompt, tokens), plain_tokens in zip(REQUESTS, expected):
        with OpNames() as ops:
            assert_identical(plain_tokens, generate(model, request(ids, prompt), tokens))
        # (at half the weights, a layer's attention and MLP are the regions)
        assert ops.count("region LlamaMLP") > 0, sorted(set(n for n in ops.names if " " in n))
        loops.append(ops.count(GENERATE))
    # the first call runs op by op, measuring what generate()'s own loop makes (Note [Loops
    # on plain tensors]; tests/regions/test_scope.py checks the calls after it)
    assert loops[0] == 0
    stats = tm.stats()
    assert stats["peak_device_bytes"] <= tm.budget and stats["max_memory_allocated"] <= tm.budget


def test_regions_off_or_torch_disabled_leave_generate_as_it_is():
    expected = plain_results(REQUESTS[:1])[0]
    model, ids = llama(), torchTensorRef.manage(prompts())
    regions.enabled = False
    with OpNames() as ops:
        got = generate(model, request(ids, REQUESTS[0][0]), REQUESTS[0][1])
    assert_identical(expected, got)
    assert ops.count(GENERATE) == 0 and ops.count("region LlamaForCausalLM") == 0 and len(ops.names) > 100


@pytest.mark.parametrize("value, settings", [
    ("a tensor", True), ([1, (2.0, "a")], True), ({"k": None, "d": torch.float16}, True),
    (transformers.GenerationConfig(max_new_tokens=3), True),
    (lambda ids, scores: scores, False), (transformers.LogitsProcessorList(), True),
    ([transformers.TemperatureLogitsWarper(0.5)], False), (transformers.DynamicCache(), False),
    (object(), False),
])
def test_only_tensors_and_settings_make_a_generate_region(value, settings):
    if value == "a tensor":
        value = torch.ones(2)  # (made here: a TensorRef made at import would outlive the tests)
    assert _settings_only(value) is settings
