"""The image pipeline's stage workers: a text stage that encodes prompts and
an image stage that denoises images from them (records:
:mod:`kvflow.schemas.images`).

:mod:`.models` loads either stage's model (the built-in tiny pipeline, or a
local diffusers directory), :mod:`.stages` turns one input record into one
output record with it, and :mod:`.stage_worker` connects a stage to its
queue topic. Nothing here but :mod:`.stage_worker` knows of Kafka.
"""
