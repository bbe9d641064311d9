"""What changes a model's trainable or stored form: LoRA (lora.py), 4-bit bases (quantize.py, nf4.py)."""
