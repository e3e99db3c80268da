"""What a pipeline stage exchanges about the tensors crossing its boundary, kept per micro-batch shape.

DeepSpeed's pipeline engine sends the receiving stage the boundary tensors' dtypes and sizes (`_send_tensor_meta`:
a message read back with a dozen host reads, on a GPU each a synchronisation) the first time, and afterwards
reuses its buffers; with token batches the shape changes between steps, so each change used to start that over
(`reset_activation_shape`). Here both sides remember, per micro-batch shape (rows, source length, target length),
what was exchanged: the sender sends a shape's metadata once per run, the receiver allocates from what it received
that time, and the tensor-parallel split records (the pipe_partition_*_meta_cache, copied to the host when made)
are kept per shape too. Which shapes are new is decided by the same sequence of shapes on every rank (all ranks
draw the same batches), so sender and receiver always agree on whether a message comes.

The receive buffers still come from the engine's one growing pool (`_allocate_or_extend_buffers`, what DeepSpeed's
`dynamic_shape` uses), so memory does not grow with the number of shapes; gradient buffers are sized from the
stage's own outputs, which needs no message. Token batches snap to few shapes
(preprocess.token_batches, `--num_batch_buckets`), so a run sends a handful of metadata messages."""

from __future__ import annotations

import torch

PARTITION_RECORDS = (
    "pipe_partition_input_meta_cache",
    "pipe_partition_output_meta_cache",
    "pipe_partition_grad_meta_cache",
    "grad_partition_grad_layer_meta_cache",
)


def _layout(buffers) -> tuple:
    """The (sizes, dtype) of received buffers, and whether they came as one tensor or a tuple."""
    if isinstance(buffers, torch.Tensor):
        return "tensor", [(list(buffers.size()), buffers.dtype)]
    return type(buffers).__name__, [(list(b.size()), b.dtype) for b in buffers]


class BoundaryMeta:
    """Installed on one DeepSpeed PipelineEngine; `expect(shape)` before each train_batch / eval_batch."""

    def __init__(self, ds_engine):
        self.ds = ds_engine
        self.shape: tuple | None = None
        self.sent: set = set()  # shapes whose metadata this stage sent to the next one
        self.received: dict = {}  # shape -> the layout this stage received from the one before
        self.partition: dict = {}  # shape -> the engine's split records for it
        self.messages = {"sent": 0, "received": 0}  # metadata messages that really crossed (tests count them)
        # the engine's parts this relies on (DeepSpeed >= 0.15, its dynamic-shape pipeline work); without them
        # the engine starts over at each change of shape, as before
        self.remembers = all(
            hasattr(ds_engine, name)
            for name in ("_send_tensor_meta", "_recv_tensor_meta", "_allocate_or_extend_buffers")
        )
        if self.remembers:
            self._send, self._recv = ds_engine._send_tensor_meta, ds_engine._recv_tensor_meta
            ds_engine._send_tensor_meta = self._send_once
            ds_engine._recv_tensor_meta = self._recv_once

    def expect(self, shape: tuple) -> None:
        """The micro-batches that come next have `shape`: point the engine at what it exchanged for that shape."""
        if shape == self.shape:
            return
        ds = self.ds
        if not self.remembers:
            if self.shape is not None:
                ds.reset_activation_shape()
            self.shape = shape
            return
        if self.shape is not None:
            self.partition[self.shape] = {name: getattr(ds, name) for name in PARTITION_RECORDS}
        self.shape = shape
        for name, value in self.partition.get(shape, dict.fromkeys(PARTITION_RECORDS)).items():
            setattr(ds, name, value)
        # the engine then asks for the boundary's buffers (its _recv_tensor_meta, answered below) and sizes its
        # gradient buffers from its own outputs; the pool it allocates both from stays
        ds.first_output_send, ds.pipe_recv_buf, ds.grad_layer, ds.meta_buffer = True, None, None, None

    def _send_once(self, buffer, recv_stage):
        if self.shape in self.sent:
            return
        self._send(buffer, recv_stage)
        self.sent.add(self.shape)
        self.messages["sent"] += 1

    def _recv_once(self, send_stage):
        known = self.received.get(self.shape)
        if known is None:
            buffers = self._recv(send_stage)
            self.received[self.shape] = _layout(buffers)
            self.messages["received"] += 1
            return buffers
        kind, layout = known
        buffers = [self.ds._allocate_or_extend_buffers(i, size, dtype) for i, (size, dtype) in enumerate(layout)]
        if kind == "tensor":
            return buffers[0]
        return tuple(buffers) if kind == "tuple" else buffers
