target_sources(smla_objects PRIVATE
  models/presets.cpp
  models/config_json.cpp
  models/gguf.cpp
  models/gguf_dequantize.cpp
  models/gguf_spec.cpp
  models/safetensors.cpp
  models/weights.cpp)
