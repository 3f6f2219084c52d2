"""A griffe extension for the API reference: Keras's docstring sections.

Keras documents a layer's `call` in its class docstring under "Call
arguments:", and examples under "Example:", titles that Google-style
parsing does not know: it would render the arguments as one paragraph and
a doctest as quoted text. This reads "Call arguments:" as a list of
arguments under that title, as "Args:" is read, and "Example:" as
"Examples:".
"""

import griffe

_TITLES = {
    "Call arguments:": "Other arguments: Call arguments:",
    "Example:": "Examples:",
}


class KerasSections(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        docstring = obj.docstring
        if docstring is None:
            return
        out = []
        indent = None  # the title's, while its block is indented under it
        for line in docstring.value.split("\n"):
            if indent is not None:
                if not line.strip() and out[-1].strip() in _TITLES.values():
                    continue  # a blank line under a title would end it
                if not line.strip():
                    indent = None
                elif _indent(line) <= indent:
                    line = "    " + line  # Keras writes `>>>` unindented
            title = line.strip()
            if title in _TITLES and (not out or not out[-1].strip()):
                line = line.replace(title, _TITLES[title])
                indent = _indent(line)
            out.append(line)
        docstring.value = "\n".join(out)


def _indent(line):
    return len(line) - len(line.lstrip())
