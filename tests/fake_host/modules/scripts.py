"""Host state: the ``Script`` base class and ``AlwaysVisible`` marker (modules/scripts.py)."""


class AlwaysVisible:
    pass


class Script:
    filename = None
    args_from = None
    args_to = None
    alwayson = False
    is_txt2img = False
    is_img2img = False
    infotext_fields = None
    paste_field_names = None
    section = None

    def title(self):
        raise NotImplementedError


scripts_txt2img = None
scripts_img2img = None
"""The ``ScriptRunner`` of each tab; a test that needs one puts it here."""
