#include <smla/select.h>

#include <cstdio>

int main() {
  const smla::AttentionSpec spec = smla::load_model_spec("glm-5");
  smla::RunSpec run;
  run.device = smla::Device::cpu();
  const smla::Selection sel = smla::select(spec, run);
  if (!sel.chosen) return 1;
  std::printf("%s heads=%d chosen=%s\n", spec.name.c_str(), spec.num_heads, sel.chosen->name().c_str());
  return 0;
}
