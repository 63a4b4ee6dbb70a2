target_sources(smla_objects PRIVATE
  cuda/device_query.cu)
