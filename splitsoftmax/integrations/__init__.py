"""Integrations with other libraries; each submodule imports its library only when used
(``splitsoftmax.integrations.transformers``: the optional extra ``hf``)."""
