"""dpcs from the trainers people already use. `dpcs_compiler.integrations.hf`: Hugging Face `Trainer` and
`accelerate` loops (imports transformers; install it, e.g. `pip install transformers accelerate`)."""
