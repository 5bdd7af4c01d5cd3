def save_image(*args, **kwargs):
    pass
