"""Data: tokenisers, Megatron's indexed format, its sample order and blends, and the
trainer's splits (fxmeg.data.megatron)."""
