"""The flow stage at run time: speech tokens -> mel, whole sentences (``stage*``) and streamed chunks
(``stream*``), with the per-voice prompt caches of the streamed forms."""
