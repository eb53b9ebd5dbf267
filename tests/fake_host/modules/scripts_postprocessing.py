"""Host state: the Extras operation base class (modules/scripts_postprocessing.py)."""


class PostprocessedImage:
    def __init__(self, image):
        self.image = image
        self.info = {}
        self.extra_images = []


class ScriptPostprocessing:
    name = None
    order = 1000

    def ui(self):
        return None

    def process_firstpass(self, pp, **args):
        pass

    def process(self, pp, **args):
        pass
