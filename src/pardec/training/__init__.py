"""CLLM training: trajectory collection (``collect``, ``trajectories``), losses (``losses``), samples and
collator (``data``), and ``CLLMConfig`` / ``CLLMTrainer`` (``trainer``). The Hydra app is ``pardec.train``."""
