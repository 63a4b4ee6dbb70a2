// Model specs: smla::AttentionSpec and its parts as Python classes with
// read-write fields, so a caller can load a preset, adjust it and explain it.
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/vector.h>

#include <sstream>

#include "bindings.h"
#include "smla/error.h"
#include "smla/spec.h"

namespace smla::python {

namespace {

RopeStyle parse_rope_style(const std::string& s) {
  if (s == rope_style_name(RopeStyle::interleaved)) return RopeStyle::interleaved;
  if (s == rope_style_name(RopeStyle::half_split)) return RopeStyle::half_split;
  fail("rope_style: expected '" + std::string(rope_style_name(RopeStyle::interleaved)) + "' or '" +
       std::string(rope_style_name(RopeStyle::half_split)) + "', got '" + s + "'");
}

std::string repr(const AttentionSpec& s) {
  std::ostringstream o;
  o << "AttentionSpec(name='" << s.name << "', model_type='" << s.model_type << "', num_heads=" << s.num_heads
    << ", q_lora_rank=" << s.q_lora_rank << ", kv_lora_rank=" << s.kv_lora_rank
    << ", qk_nope_head_dim=" << s.qk_nope_head_dim << ", qk_rope_head_dim=" << s.qk_rope_head_dim
    << ", v_head_dim=" << s.v_head_dim << ", softmax_scale=" << s.softmax_scale
    << ", sparse=" << (s.is_sparse() ? "True" : "False") << ")";
  return o.str();
}

}  // namespace

void bind_specs(nb::module_& m) {
  nb::class_<RopeSpec>(m, "RopeSpec", "RoPE parameters; yarn=False (or factor 1) means no context extension.")
      .def(nb::init<>())
      .def_rw("theta", &RopeSpec::theta)
      .def_rw("yarn", &RopeSpec::yarn)
      .def_rw("factor", &RopeSpec::factor)
      .def_rw("original_max_position_embeddings", &RopeSpec::original_max_position_embeddings)
      .def_rw("beta_fast", &RopeSpec::beta_fast)
      .def_rw("beta_slow", &RopeSpec::beta_slow)
      .def_rw("mscale", &RopeSpec::mscale)
      .def_rw("mscale_all_dim", &RopeSpec::mscale_all_dim)
      .def("__repr__", [](const RopeSpec& r) {
        std::ostringstream o;
        o << "RopeSpec(theta=" << r.theta << ", yarn=" << (r.yarn ? "True" : "False") << ", factor=" << r.factor
          << ")";
        return o.str();
      });

  nb::class_<IndexerSpec>(m, "IndexerSpec", "The DSA lightning indexer's geometry.")
      .def(nb::init<>())
      .def_rw("heads", &IndexerSpec::heads)
      .def_rw("head_dim", &IndexerSpec::head_dim)
      .def_rw("topk", &IndexerSpec::topk)
      .def_rw("kpool", &IndexerSpec::kpool, "tokens per pooled index key (index_kpool; 1: one per token)")
      .def_rw("always_select_tail", &IndexerSpec::always_select_tail)
      .def_prop_rw(
          "rope_style", [](const IndexerSpec& s) { return std::string(rope_style_name(s.rope_style)); },
          [](IndexerSpec& s, const std::string& v) { s.rope_style = parse_rope_style(v); })
      .def("__repr__", [](const IndexerSpec& s) {
        return "IndexerSpec(heads=" + std::to_string(s.heads) + ", head_dim=" + std::to_string(s.head_dim) +
               ", topk=" + std::to_string(s.topk) + ", rope_style='" + std::string(rope_style_name(s.rope_style)) +
               "', kpool=" + std::to_string(s.kpool) + ")";
      });

  nb::class_<AttentionSpec>(m, "AttentionSpec",
                            "A model's attention geometry (all heads, before tensor parallelism), as "
                            "smla.load_model_spec returns it. Fields are writable; validate() checks them.")
      .def(nb::init<>())
      .def_rw("name", &AttentionSpec::name)
      .def_rw("model_type", &AttentionSpec::model_type)
      .def_rw("hidden_size", &AttentionSpec::hidden_size)
      .def_rw("num_heads", &AttentionSpec::num_heads)
      .def_rw("q_lora_rank", &AttentionSpec::q_lora_rank)
      .def_rw("kv_lora_rank", &AttentionSpec::kv_lora_rank)
      .def_rw("qk_nope_head_dim", &AttentionSpec::qk_nope_head_dim)
      .def_rw("qk_rope_head_dim", &AttentionSpec::qk_rope_head_dim)
      .def_rw("v_head_dim", &AttentionSpec::v_head_dim)
      .def_rw("num_layers", &AttentionSpec::num_layers)
      .def_rw("num_attention_layers", &AttentionSpec::num_attention_layers,
              "layers that run MLA (hybrid models run linear attention in the rest)")
      .def_rw("rms_norm_eps", &AttentionSpec::rms_norm_eps)
      .def_rw("rope", &AttentionSpec::rope)
      .def_prop_rw(
          "rope_style", [](const AttentionSpec& s) { return std::string(rope_style_name(s.rope_style)); },
          [](AttentionSpec& s, const std::string& v) { s.rope_style = parse_rope_style(v); })
      .def_rw("indexer", &AttentionSpec::indexer)
      .def_rw("softmax_scale", &AttentionSpec::softmax_scale)
      .def_prop_ro("is_sparse", &AttentionSpec::is_sparse)
      .def_prop_ro("qk_head_dim", &AttentionSpec::qk_head_dim)
      .def_prop_ro("absorbed_qk_dim", &AttentionSpec::absorbed_qk_dim)
      .def_prop_ro("absorbed_v_dim", &AttentionSpec::absorbed_v_dim)
      .def(
          "validate", [](const AttentionSpec& s) { validate(s, s.name.empty() ? "AttentionSpec" : s.name); },
          "Checks the geometry; raises InvalidArgumentError naming the field at fault.")
      .def("__repr__", &repr);

  m.def("preset_names", &preset_names, "The built-in model presets.");
  m.def("load_model_spec", [](const std::string& model) { return load_model_spec(model); }, nb::arg("model"),
        "A preset name or a Hugging Face config.json path -> AttentionSpec.");
  m.def(
      "spec_from_config_json",
      [](const std::string& text, const std::string& source) { return spec_from_config_json(text, source); },
      nb::arg("text"), nb::arg("source") = "config.json", "A config.json's text -> AttentionSpec.");
  m.def("reference_softmax_scale", &reference_softmax_scale, nb::arg("qk_head_dim"), nb::arg("rope"),
        "(nope + rope)^-0.5, times mscale^2 with YaRN.");
}

}  // namespace smla::python
