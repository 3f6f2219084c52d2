"""A griffe extension for the docs: Keras's "Call arguments:" section.

Keras documents a layer's `call` in its class docstring under
"Call arguments:", a title that Google-style parsing does not know (it
would render the arguments as one paragraph). This reads the section as a
list of arguments titled "Call arguments:", as "Args:" is read.
"""

import griffe

_TITLE = "\n{indent}Call arguments:\n"
_AS_ARGUMENTS = "\n{indent}Other arguments: Call arguments:\n"


class CallArguments(griffe.Extension):
    def on_instance(self, *, obj, **kwargs):
        docstring = obj.docstring
        if docstring is None:
            return
        for indent in ("", "    ", "        "):
            docstring.value = docstring.value.replace(
                _TITLE.format(indent=indent),
                _AS_ARGUMENTS.format(indent=indent),
            )
