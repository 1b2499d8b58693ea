"""Training one model: the task interface (build the model, stream batches, the loss), the
single-process trainer, the demo, and the validation the auxiliary peer runs at checkpoints."""
