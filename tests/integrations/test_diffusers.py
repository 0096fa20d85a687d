"""diffusers' models and pipelines, unmodified, under each strategy at budgets below their
weights: images, latents, losses and parameters equal to plain torch's on the device.

Small configs with random weights (nothing is downloaded): a conditional UNet stepped by a
DDIM scheduler, a DiT transformer denoiser with its VAE decode (``DiTPipeline``), an
unconditional ``DDPMPipeline``, and AdamW training steps of the UNet.
"""

from __future__ import annotations

import pytest
import torch

from torchTensorRef import strategies, tensorsManager as tm
from paired import budget, device_type, plain_torch

diffusers = pytest.importorskip("diffusers")
# (loaded here, on no device: diffusers' lazy modules make module-level tensors as they load,
# which loading them inside plain_torch() put on the device for good, where every later test
# read them as bytes outside the manager)
for _name in ("UNet2DConditionModel", "DiTTransformer2DModel", "AutoencoderKL", "DiTPipeline", "DDIMScheduler",
              "UNet2DModel", "DDPMPipeline", "DDPMScheduler"):
    getattr(diffusers, _name)


def unet():
    torch.manual_seed(0)
    return diffusers.UNet2DConditionModel(
        block_out_channels=(32, 64), layers_per_block=1, sample_size=16, in_channels=4, out_channels=4,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, norm_num_groups=8, attention_head_dim=4)


def dit_pipeline():
    torch.manual_seed(0)
    transformer = diffusers.DiTTransformer2DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=8, num_layers=2, sample_size=8,
        patch_size=2, num_embeds_ada_norm=1000, norm_num_groups=8)
    vae = diffusers.AutoencoderKL(
        block_out_channels=(16, 32), in_channels=3, out_channels=3, latent_channels=4, norm_num_groups=8,
        down_block_types=("DownEncoderBlock2D",) * 2, up_block_types=("UpDecoderBlock2D",) * 2, sample_size=16)
    return diffusers.DiTPipeline(transformer=transformer.eval(), vae=vae.eval(),
                                 scheduler=diffusers.DDIMScheduler(num_train_timesteps=100))


def ddpm_pipeline():
    torch.manual_seed(0)
    model = diffusers.UNet2DModel(
        sample_size=16, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(16, 32),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=8)
    return diffusers.DDPMPipeline(unet=model.eval(), scheduler=diffusers.DDPMScheduler(num_train_timesteps=10))


def weights(*modules) -> int:
    return sum(tm.block_bytes(p.numel() * p.element_size()) for m in modules for p in m.parameters())


def denoise(model, device=None):
    """Four DDIM steps of the UNet from seeded noise with classifier-free guidance (the
    latents twice, with and without the text, as the pipelines run it); the final latents."""
    scheduler = diffusers.DDIMScheduler(num_train_timesteps=100)
    scheduler.set_timesteps(4)
    g = torch.Generator().manual_seed(1)
    latents, text = torch.randn(1, 4, 16, 16, generator=g), torch.randn(2, 7, 32, generator=g)
    if device is not None:
        latents, text = latents.to(device), text.to(device)
    with torch.no_grad():
        for t in scheduler.timesteps:
            unconditional, conditional = model(torch.cat([latents] * 2), t, encoder_hidden_states=text).sample.chunk(2)
            eps = unconditional + 7.5 * (conditional - unconditional)
            latents = scheduler.step(eps, t, latents).prev_sample
    return latents.cpu()


def under(strategy, fraction, *modules):
    tm.strategy = strategy
    tm.budget = budget(int(fraction * weights(*modules)))
    tm.reset_stats()


def check_paged():
    s = tm.stats()
    assert s["evictions"] > 0 and s["peak_device_bytes"] <= tm.budget


@pytest.mark.parametrize("fraction", [0.5, 0.25])
@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_a_unet_denoising_loop_below_its_weights_equals_plain_torch(strategy, fraction):
    # (at a quarter, GEGLU's product of one half of its projection by the activation of the
    # other is larger than the budget: it runs in rows, the half cut in windows of its bytes)
    with plain_torch():
        expected = denoise(unet().eval().to(tm.torch_device), tm.torch_device)
    model = unet().eval()
    under(strategy, fraction, model)
    got = denoise(model)
    if device_type() == "cuda":
        # (attention's bmm runs in groups of batch elements there, and cuBLAS picks its kernel
        # by the shape it is given: equal up to rounding, docs/concepts.md)
        torch.testing.assert_close(got, expected)
    else:
        assert torch.equal(got, expected)
    check_paged()


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_a_dit_pipeline_with_its_vae_decode_at_a_quarter_of_its_weights_equals_plain_torch(strategy):
    def run(pipe):
        g = torch.Generator().manual_seed(1)
        return pipe(class_labels=[1, 3], num_inference_steps=3, generator=g, output_type="pt").images.cpu()

    with plain_torch():
        expected = run(dit_pipeline().to(tm.torch_device))
    pipe = dit_pipeline()
    under(strategy, 0.25, pipe.transformer, pipe.vae)
    assert torch.equal(run(pipe), expected)
    check_paged()


@pytest.mark.parametrize("strategy", strategies.NAMES)
def test_a_ddpm_pipeline_at_half_its_weights_equals_plain_torch(strategy):
    def run(pipe):
        g = torch.Generator().manual_seed(1)
        return torch.as_tensor(pipe(batch_size=1, num_inference_steps=3, generator=g, output_type="np").images)

    with plain_torch():
        expected = run(ddpm_pipeline().to(tm.torch_device))
    pipe = ddpm_pipeline()
    under(strategy, 0.5, pipe.unet)
    assert torch.equal(run(pipe), expected)
    check_paged()


def train(model, device=None, steps=2):
    """AdamW steps of the UNet on a noise-prediction loss; (losses, parameters)."""
    scheduler = diffusers.DDPMScheduler(num_train_timesteps=100)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        batch = [torch.randn(2, 4, 16, 16, generator=g), torch.randn(2, 7, 32, generator=g),
                 torch.randn(2, 4, 16, 16, generator=g), torch.randint(0, 100, (2,), generator=g)]
        if device is not None:
            batch = [t.to(device) for t in batch]
        latents, text, noise, t = batch
        loss = torch.nn.functional.mse_loss(
            model(scheduler.add_noise(latents, noise, t), t, encoder_hidden_states=text).sample, noise)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().cpu())
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.fixture
def deterministic_cudnn():
    """cuDNN's deterministic algorithms for the test's plain and managed runs: the ones it picks
    otherwise for a convolution's backward may sum with atomics, and plain CUDA torch's own two
    runs of ``train`` then part in the last bits of the second loss."""
    cudnn = torch.backends.cudnn
    # (through flags(): PyTorch's own test utilities, which other tests import, freeze the
    # global flags; the others stay as they are)
    with cudnn.flags(enabled=cudnn.enabled, benchmark=cudnn.benchmark, deterministic=True,
                     allow_tf32=cudnn.allow_tf32):
        yield


@pytest.mark.parametrize("fraction", [1.0, 0.25])
@pytest.mark.parametrize("strategy", strategies.NAMES)
@pytest.mark.usefixtures("deterministic_cudnn")
def test_unet_training_steps_under_a_budget_of_its_weights_equal_plain_torch(strategy, fraction):
    # (at 1.0, weights, gradients and AdamW's two moments: four times the budget; at 0.25 the
    # GEGLU's activation is larger than the room, and its gelu_backward was refused)
    with plain_torch():
        expected = train(unet().to(tm.torch_device), tm.torch_device)
    model = unet()
    under(strategy, fraction, model)
    losses, params = train(model)
    assert all(torch.equal(a, b) for a, b in zip(losses, expected[0]))
    assert all(torch.equal(a, b) for a, b in zip(params, expected[1]))
    check_paged()
