"""Hugging Face's ``Trainer`` as a user runs it, for the tests and bench/fit_training.py: a few steps on an in-memory
data set, the losses it logs returned."""

from transformers import Trainer, TrainerCallback, TrainingArguments
from transformers.trainer_callback import PrinterCallback


class _LoggedLosses(TrainerCallback):
    def __init__(self):
        self.losses = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def trainer_losses(module, data: list, folder: str, *, steps: int, batch_size: int, lr: float, seed: int,
                   data_collator=None) -> list:
    """The losses ``Trainer`` logs at each of ``steps`` steps training ``module`` on ``data`` (a list of examples),
    ``batch_size`` to a step, at learning rate ``lr``, its data order drawn from ``seed``; nothing saved, reported
    or printed (its files under ``folder``)."""
    losses = _LoggedLosses()
    arguments = TrainingArguments(output_dir=folder, max_steps=steps, per_device_train_batch_size=batch_size,
                                  learning_rate=lr, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
                                  dataloader_num_workers=0, seed=seed, disable_tqdm=True)
    trainer = Trainer(model=module, args=arguments, train_dataset=data, data_collator=data_collator,
                      callbacks=[losses])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    return losses.losses
