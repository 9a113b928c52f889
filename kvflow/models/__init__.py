"""Model files and tokenizers, shared by the workers and the HTTP bridge.

:mod:`kvflow.models.resolve` turns a model spec into a local model
directory; :mod:`kvflow.models.tokenizer` loads a model's tokenizer (or the
byte tokenizer). Engines load both; the bridge tokenizes prompts with the
tokenizer its workers advertise, so it must not depend on the workers.
"""
