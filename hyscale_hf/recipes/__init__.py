"""Runnable training recipes built on the public hyscale_hf API (see ``finetune_long``)."""
