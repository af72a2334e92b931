"""Training, one package per experiment kind on shared pieces (the Hydra app is :mod:`pardec.train`).

* :mod:`.kinds`: the KINDS registry, the Kind base (validation + ``stage_<name>`` methods) and the shared checks;
* :mod:`.base`: the BaseConfig / BaseTrainer pair (loss normalisation under accumulation and over ranks, logged
  sums, DeepSpeed set-up, LoRA, saving, fit);
* :mod:`.checkpoints`: checkpoints marked complete after their save, and the one a resume takes;
* :mod:`.stages`: the resumable, sharded data-generation stage; :mod:`.completions`: the target's own completions;
  :mod:`.losses`: pure loss functions;
* the kinds: :mod:`.cllm`, :mod:`.draft`, :mod:`.drafter`, :mod:`.sdsat`.
"""
