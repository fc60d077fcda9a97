"""Exporters and generators (``[export]`` extra): random-weight fixtures in the official layout; ONNX export
and quantization recipes are the next milestone. Importing a submodule may need torch."""
