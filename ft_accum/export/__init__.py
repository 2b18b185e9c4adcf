"""export layer: GGUF files, the Ollama Modelfile and the llama.cpp check (above models/ and training/)."""
