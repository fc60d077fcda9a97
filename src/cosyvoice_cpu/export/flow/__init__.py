"""The flow graphs per family (one module each, the streamed estimators in ``*_stream`` siblings) and the graph
pieces they share (:mod:`.common`)."""
