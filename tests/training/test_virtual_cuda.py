"""Every trainer's training step on a virtual CUDA device (pardec.testing): the accumulation window's counts
(``get_batch_samples`` on the device), ``compute_loss``, backward and the logged sums, with the model, its
frozen teacher/base and the batch on ``cuda:0``. A CPU tensor meeting them fails as it would on a GPU; the loss
equals the CPU one, and every gradient lands on the device."""

from __future__ import annotations

import copy

import pytest
import torch

from pardec.models import adaptive
from pardec.models.cached import CachedModel
from pardec.models.draft import build_draft
from pardec.models.drafters import new_drafter
from pardec.testing import VirtualCUDA
from pardec.training.cllm.data import CLLMCollator, TrajectoryDataset
from pardec.training.cllm.trainer import CLLMConfig, CLLMTrainer
from pardec.training.completions import CompletionCollator, CompletionDataset
from pardec.training.draft.trainer import DraftConfig, DraftTrainer
from pardec.training.drafter.batches import RightPadCollator
from pardec.training.drafter.trainer import DrafterConfig, DrafterTrainer
from pardec.training.sdsat.trainer import SDSATCollator, SDSATConfig, SDSATDataset, SDSATTrainer
from tests.conftest import VOCAB, tiny
from tests.training.cllm.helpers import jacobi_trajectories

COMPLETIONS = [{"prompt_ids": [700, 701, 702, 703, 704], "completion_ids": [10, 11, 12, 13, 14, 15]},
               {"prompt_ids": [800, 801, 802], "completion_ids": [20, 21, 22]}]


def _args(cls, tmp_path, **kw):
    return cls(output_dir=str(tmp_path), use_cpu=True, report_to="none", save_strategy="no", logging_steps=1, **kw)


def _cllm(tmp_path):
    lm = tiny()
    prompts = [lm.tokenizer(t)["input_ids"] for t in ("Tom has 3 apples.", "def add(a, b):")]
    gens = [torch.Generator().manual_seed(i) for i in range(len(prompts))]
    out = jacobi_trajectories(CachedModel(lm.model), prompts, 4, 8, set(), gens)
    records = [{"id": str(i), "prompt_ids": p, **r} for i, (p, r) in enumerate(zip(prompts, out))]
    args = _args(CLLMConfig, tmp_path, states_per_sample=2)
    ds = TrajectoryDataset(records, args.loss_type, args.state_sampling, args.max_length, args.seed,
                           args.states_per_sample)
    model = copy.deepcopy(lm.model)
    collator = CLLMCollator(lm.tokenizer.pad_token_id)
    return CLLMTrainer(model=model, args=args, train_dataset=ds, data_collator=collator), [model], collator


def _draft(tmp_path):
    lm = tiny()
    ds = CompletionDataset(COMPLETIONS)
    student = build_draft(lm.model, [1], list(range(0, VOCAB, 7)))
    teacher = copy.deepcopy(lm.model)
    trainer = DraftTrainer(model=student, args=_args(DraftConfig, tmp_path), train_dataset=ds,
                           data_collator=CompletionCollator(0), teacher=teacher)
    return trainer, [student, trainer.teacher], CompletionCollator(0)


def _draft_cached(tmp_path):
    """The draft trainer without a teacher model: the teacher's top-k log-probs come with the batch."""
    lm = tiny()
    g = torch.Generator().manual_seed(0)
    records = [{**r, "teacher_ids": [torch.randperm(VOCAB, generator=g)[:6].tolist() for _ in r["completion_ids"]],
                "teacher_logprobs": [sorted((-3 * torch.rand(6, generator=g)).tolist(), reverse=True)
                                     for _ in r["completion_ids"]]} for r in COMPLETIONS]
    ds = CompletionDataset(records, teacher=True)
    student = build_draft(lm.model, [1], list(range(0, VOCAB, 7)))
    trainer = DraftTrainer(model=student, args=_args(DraftConfig, tmp_path, teacher="cached"), train_dataset=ds,
                           data_collator=CompletionCollator(0), teacher=None)
    return trainer, [student], CompletionCollator(0)


def _heads(kind):
    def make(tmp_path):
        base = copy.deepcopy(tiny().model).requires_grad_(False)
        drafter = (new_drafter("medusa", base.config, num_heads=3, lm_head=base.lm_head) if kind == "medusa"
                   else new_drafter("firp", base.config, layers=[0, 1, 1]))
        trainer = DrafterTrainer(model=drafter, args=_args(DrafterConfig, tmp_path), base=base,
                               train_dataset=CompletionDataset(COMPLETIONS, max_length=64),
                               data_collator=RightPadCollator(0))
        return trainer, [drafter, base], RightPadCollator(0)
    return make


def _sdsat(tmp_path):
    lm = tiny()
    model = copy.deepcopy(lm.model)
    (aid,) = adaptive.attach_adaptive(model, lm.tokenizer, adaptive.adaptive_tokens(3, False), 3, False)
    records = [{"ids": [10, 11, 12, 13, 14, 15, 16, 17], "start": 3,
                "masked_ids": [10, 11, 12, aid, aid, 15, aid, 17], "masked": 3},
               {"ids": [20, 21, 22, 23, 24], "start": 0, "masked_ids": [20, aid, 22, 23, 24], "masked": 1}]
    trainer = SDSATTrainer(model=model, args=_args(SDSATConfig, tmp_path), train_dataset=SDSATDataset(records),
                           data_collator=SDSATCollator(0))
    return trainer, [model], SDSATCollator(0)


KINDS = {"cllm": _cllm, "draft": _draft, "draft_cached": _draft_cached, "heads_medusa": _heads("medusa"), "heads_firp": _heads("firp"),
         "sdsat": _sdsat}


def _step(trainer, collator, device=None):
    """One training step as the Trainer's loop makes it: window counts, loss, backward, then a log."""
    ds = trainer.train_dataset
    batch = collator([ds[i] for i in range(min(2, len(ds)))])
    if device is not None:
        batch = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
    (batch,), counts = trainer.get_batch_samples(iter([batch]), 1, device or torch.device("cpu"))
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, batch, num_items_in_batch=counts)
    loss.backward()
    logs = {"loss": float(loss.detach())}
    trainer.log(logs)
    return logs


@pytest.mark.parametrize("kind", list(KINDS))
def test_training_step_runs_on_cuda(tmp_path, kind):
    trainer, _, collator = KINDS[kind](tmp_path / "cpu")
    on_cpu = _step(trainer, collator)
    trainer, models, collator = KINDS[kind](tmp_path / "cuda")
    with VirtualCUDA() as vc:
        for m in models:
            vc.place(m)
        on_cuda = _step(trainer, collator, torch.device("cuda", 0))
        trained = [p for p in trainer.model.parameters() if p.requires_grad]
        assert trained and all(p.grad is not None and p.grad.device.type == "cuda" for p in trained)
    assert on_cuda == pytest.approx(on_cpu, rel=1e-5)
