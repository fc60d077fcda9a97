"""Graph sessions: the interface every inference backend implements and the ONNX Runtime implementation."""
