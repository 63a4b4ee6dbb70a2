// The _smla extension module. The public Python API is python/smla; this
// module is its thin C++ layer.
#include "bindings.h"
#include "smla/error.h"

namespace smla::python {

namespace {

// smla::Error -> one Python class per ErrorKind, all under smla.Error (a
// RuntimeError); bad input is also a ValueError. Created here so that C++ and
// the Python layer (which re-exports them) raise the same classes.
PyObject* g_error = nullptr;
PyObject* g_invalid = nullptr;
PyObject* g_unsupported = nullptr;
PyObject* g_io = nullptr;
PyObject* g_internal = nullptr;

PyObject* new_error(nb::module_& m, const char* name, PyObject* bases, const char* doc) {
  const std::string qualified = std::string("smla.") + name;
  PyObject* cls = PyErr_NewExceptionWithDoc(qualified.c_str(), doc, bases, nullptr);
  if (!cls) throw nb::python_error();
  m.attr(name) = nb::handle(cls);
  return cls;
}

}  // namespace

void bind_errors(nb::module_& m) {
  g_error = new_error(m, "Error", PyExc_RuntimeError, "Base class of every error smla raises.");
  nb::object invalid_bases = nb::make_tuple(nb::handle(g_error), nb::handle(PyExc_ValueError));
  g_invalid = new_error(m, "InvalidArgumentError", invalid_bases.ptr(),
                        "Bad input: a tensor's shape, dtype, device or strides, a value, a config field.");
  g_unsupported = new_error(m, "UnsupportedError", g_error,
                            "Valid input that no backend (or the one asked for) can run.");
  g_io = new_error(m, "FileError", g_error, "A file (a model config) that cannot be read.");
  g_internal = new_error(m, "InternalError", g_error, "A failure inside a backend, e.g. a CUDA runtime error.");

  nb::register_exception_translator([](const std::exception_ptr& p, void*) {
    try {
      std::rethrow_exception(p);
    } catch (const Error& e) {
      PyObject* cls = g_internal;
      switch (e.kind()) {
        case ErrorKind::invalid_argument: cls = g_invalid; break;
        case ErrorKind::unsupported: cls = g_unsupported; break;
        case ErrorKind::io: cls = g_io; break;
        case ErrorKind::internal: cls = g_internal; break;
      }
      PyErr_SetString(cls, e.what());
    }
  });
}

}  // namespace smla::python

NB_MODULE(_smla, m) {
  m.doc() = "smla's C++ layer; use the `smla` package.";
  smla::python::bind_errors(m);
  smla::python::bind_specs(m);
  smla::python::bind_explain(m);
  smla::python::bind_ops(m);
#ifdef SMLA_WITH_CUDA
  m.attr("with_cuda") = true;
#else
  m.attr("with_cuda") = false;
#endif
}
