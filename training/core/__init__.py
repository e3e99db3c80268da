"""The training step and what it stands on: the process group (distributed), the DeepSpeed engine (engine), data
feeding (data), the loss normalisation (objective), the global gradient norm (grad_norm), the learning-rate
schedule (schedule), one step (step), and what a step reports (metrics, speed)."""
