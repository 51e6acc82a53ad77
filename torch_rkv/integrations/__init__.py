"""Optional integrations (import the submodule you need: `torch_rkv.integrations.transformers`)."""
