"""pipeline_funcs with the seed's signature, loaded by name (`--pipeline_func tests.pipeline_funcs:NAME`) in the
tests: the tutorial's own lambda, and broken ones for the error messages."""


def seed_tutorial(network, layer_id, offset, parallel_config, layers):
    """The lambda of the seed's `Net` (tutorials 001/002, model.py) as written there — blocks on stage
    max((i + offset) / layers_per_stage, 1), gradient fusion ids from a group of 4 — plus the recompute the tutorial
    says a pipeline_func may switch on, here for every other block only. The tutorial's `layers_per_stage` comes
    from the enclosing Net: (encoder + decoder layers + 2) // pipeline_stage; `layers` here is encoder + decoder."""
    layers_per_stage = (layers + 2) // parallel_config.pipeline_stage
    pp_id = max(int(layer_id + offset) / layers_per_stage, 1)
    network.pipeline_stage = int(pp_id)
    gradient_aggregation_group = 4
    dis = max(int((layer_id + offset) / gradient_aggregation_group), 1)
    network.set_comm_fusion(int((layer_id + offset) / dis) + 1)
    if parallel_config.recompute and (layer_id + offset) % 2 == 0:
        network.recompute()
    print(f"pipeline id is:{pp_id}", flush=True)


def encoder_only_recompute(network, layer_id, offset, parallel_config, layers):
    """Even split; recompute the encoder blocks (offset 0) and keep the decoder's activations."""
    network.pipeline_stage = (layer_id + offset) * parallel_config.pipeline_stage // layers
    if offset == 0:
        network.recompute()


def raises_on_decoder(network, layer_id, offset, parallel_config, layers):
    if offset:
        raise KeyError("no stage table entry for this block")
    network.pipeline_stage = 0


def out_of_range(network, layer_id, offset, parallel_config, layers):
    network.pipeline_stage = layer_id + offset + 1  # one past the last stage for the last block


def decreasing(network, layer_id, offset, parallel_config, layers):
    network.pipeline_stage = parallel_config.pipeline_stage - 1 - (layer_id + offset) % parallel_config.pipeline_stage


def float_stage(network, layer_id, offset, parallel_config, layers):
    network.pipeline_stage = (layer_id + offset) / layers  # forgot int()


def skips_a_stage(network, layer_id, offset, parallel_config, layers):
    network.pipeline_stage = 0 if offset == 0 else parallel_config.pipeline_stage - 1


def every_block_on_stage_0(network, layer_id, offset, parallel_config, layers):
    """The split plan.py's balance advice names for the seed's 16pcs ("move decoder.0 to stage 0"): every block on
    the first stage, the head alone on the last (tests/test_plan_advice.py re-plans it through --pipeline_func)."""
    network.pipeline_stage = 0
