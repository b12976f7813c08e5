"""The peer server of loadtest/bench_peer.py: llama.cpp's llama-server, built outside the repository
(`llama`), on GGUF conversions of the zoo models (`gguf`), and the servers each arm starts (`servers`)."""
