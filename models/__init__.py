"""Plain single-device reference models. They never import fxmeg."""
